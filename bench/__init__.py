"""Benchmarks and device scripts, above the serving packages: each prints a table and writes
JSON; none is a test. engine (tok/s, TTFT per concurrency), engine_context (prefill/decode by
context), host_step (an engine step's host time by phase), federation_bench (routing overhead,
1 vs 2 replicas), kernel_bench (GPU kernels), sass_report (offline SASS of the q4 GEMM loop),
gpu_run.sh (one device call)."""
