"""study: probes, multi-run studies, reports, plots and the demo."""
