"""draftport's KV connector for vLLM: the hidden states vLLM's `extract_hidden_states` method caches, one
safetensors file per request that asks for them, in a spool folder the capture driver reads
(serving/vllm_capture.py turns them into store shards).

vLLM loads this class itself (`kv_transfer_config.kv_connector_module_path`), in every worker process of
a tensor-parallel engine and in its scheduler; only this module imports vLLM at its top, and nothing in
draftport imports it: the driver names it by its dotted path.

How the states travel. With `speculative_config={"method": "extract_hidden_states", ...}` vLLM's model runner
hands the residual stream entering each listed layer (`eagle_aux_hidden_state_layer_ids`, vLLM's ids: the
input of decoder layer i, i = L being the last layer's output before the final norm) to a cache-only
attention layer, which writes them into KV-cache blocks of their own group: [tokens, ids, hidden] per
request. When a request finishes, the scheduler side (`request_finished`) keeps its blocks alive and sends
their ids to the workers with the next step's metadata; the tensor-parallel rank 0 worker (the states are
whole on every rank) gathers the request's rows, copies them to the host and writes
`<spool>/<name>.safetensors` (`states` [T, ids, H] in the engine's dtype, `token_ids` int64 [T]) under a
temporary name, renamed when whole, so a file that exists is complete. Only requests whose
`kv_transfer_params` carry `draftport_sample` (a plain file name) are saved: the same engine regenerates
answers without writing anything.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                KVConnectorRole, SupportsHMA)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

from draftport.serving.vllm_capture import PATH_KEY, SAMPLE_KEY, SPOOL_KEY, spool_file, write_states

WRITERS = 4                        # disk writes in flight beside the engine's steps


@dataclass
class Save:
    req_id: str
    path: str
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class StatesMetadata(KVConnectorMetadata):
    saves: list[Save] = field(default_factory=list)


class DraftportStatesConnector(KVConnectorBase_V1, SupportsHMA):
    """Store-only connector: nothing is ever loaded back into vLLM's cache."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        spool = self._kv_transfer_config.get_from_extra_config(SPOOL_KEY, None)
        if not spool:
            raise ValueError(f"DraftportStatesConnector needs kv_connector_extra_config[{SPOOL_KEY!r}]")
        if vllm_config.speculative_config is None or vllm_config.speculative_config.method != "extract_hidden_states":
            raise ValueError("DraftportStatesConnector needs speculative_config method 'extract_hidden_states'")
        self.spool = os.fspath(spool)
        self.group = self._states_group(kv_cache_config)
        self._waiting: dict[str, Save] = {}     # scheduler: finished, blocks held, not yet sent to the workers
        self._cache: torch.Tensor | None = None  # worker: the states' cache
        self._rank0 = True
        self._written: set[str] = set()           # worker: copied to the host (blocks may be freed)
        self._finished: set[str] = set()          # worker: ids the scheduler said finished
        self._pool: ThreadPoolExecutor | None = None
        self._writes: list[Future] = []

    @staticmethod
    def _states_group(kv_cache_config) -> int:
        """The KV-cache group holding the states (the cache-only layer's spec), on both sides; one group holds
        every layer where vLLM does not split them (its CPU backend)."""
        if kv_cache_config is None:
            return 0
        from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

        groups = kv_cache_config.kv_cache_groups
        found = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
        if not found and len(groups) == 1:
            return 0
        if len(found) != 1:
            raise ValueError(f"expected one hidden-states KV-cache group, found {len(found)} of {len(groups)}")
        return found[0]

    def get_finished_count(self) -> int:
        return 1  # only tensor-parallel rank 0 writes, so one notice a request

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        self._rank0 = get_tensor_model_parallel_rank() == 0
        names = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(names) != 1:
            raise ValueError(f"expected one cache-only attention layer, found {names}")
        self._cache = kv_caches[names[0]]  # [blocks, ids, block size, hidden]

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        pass  # the cache-only layer already wrote the states; they are read when the request finishes

    def wait_for_save(self) -> None:
        pass

    def _rows(self, save: Save) -> torch.Tensor:
        """The request's states [T, ids, H], gathered from its blocks in order."""
        cache = self._cache
        block = cache.shape[2]
        blocks = torch.tensor(save.block_ids, dtype=torch.long, device=cache.device)
        slots = (blocks[:, None] * block + torch.arange(block, device=cache.device)[None, :]).reshape(-1)
        slots = slots[:len(save.token_ids)]
        return cache[slots // block, :, slots % block]

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._finished |= set(finished_req_ids)
        if self._rank0 and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            for save in getattr(meta, "saves", ()):
                host = self._rows(save).to("cpu")  # after this the blocks may be reused
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(WRITERS, thread_name_prefix="draftport-states")
                os.makedirs(self.spool, exist_ok=True)
                self._writes.append(self._pool.submit(write_states, save.path, host,
                                                      torch.tensor(save.token_ids, dtype=torch.int64)))
                self._written.add(save.req_id)
        for f in [f for f in self._writes if f.done()]:
            self._writes.remove(f)
            f.result()  # a failed write fails the step, loudly, rather than leaving a sample missing
        done = self._written & self._finished
        self._written -= done
        self._finished -= done
        return done or None, None

    def shutdown(self):
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            for f in self._writes:
                f.result()
            self._writes.clear()

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        pass

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = StatesMetadata(saves=list(self._waiting.values()))
        self._waiting.clear()
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        name = (request.kv_transfer_params or {}).get(SAMPLE_KEY)
        if name is None or request.prompt_token_ids is None:
            return False, None
        path = spool_file(self.spool, name)
        # the prompt's states only: a generated token never went through a forward pass as input
        self._waiting[request.request_id] = Save(request.request_id, path, list(request.prompt_token_ids),
                                                 list(block_ids))
        return True, {PATH_KEY: path}

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        if not 0 <= self.group < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self.group])

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        return None
