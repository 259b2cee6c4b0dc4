"""The runtime's defaults that the command line shows in ``--help`` (the scheduler's budgets,
:class:`~dist_runtime.scheduling.Scheduler`; the KV caches' element types), in a module that
imports nothing, so that ``--help`` loads no numpy; the partitioner plans with the same ones."""

#: Rows per pass when the caller does not say.  Measured (benchmarks/bench_batching.py, 125M Llama,
#: F32, TBB threads): with 8 sessions decoding while 4 prompts of 512 tokens arrive, the decoding
#: sessions' p99 inter-token time is ~1.5 decode steps at 24 rows a pass, since prompts beside D
#: decode rows fill a pass to a quarter of the budget or add D/2 rows (``Scheduler.next_batch``).
DEFAULT_BATCH_TOKENS = 24
#: Prompt rows a pass may take while no session is generating (no one waits between tokens).
IDLE_PREFILL_TOKENS = 512
#: What a KV cache may keep K and V in, by the name a user gives (``--kv-dtype``, or a model's
#: ``kv_dtype`` metadata).  F16 halves the caches' memory at the same decode speed, as llama.cpp's
#: default does; Q8_0 (GGML's blocks of 32) takes 17/32 of F16's (kernels/attention.py's
#: ``KvState``; docs/architecture.md states their accuracy).
KV_DTYPE_NAMES = ("f16", "f32", "q8_0")
DEFAULT_KV_DTYPE = "f16"
#: Rows a KV cache grows by: a session's caches take whole blocks as its context grows, at least an
#: eighth more each time (appends stay amortised O(1)), never past its request's ceiling
#: (kernels/attention.py's ``KvState``).  llama.cpp pads its context to 256 rows too.
KV_BLOCK = 256
#: How the compiled products multiply quantized weights (``--numerics``): each weight type's
#: faster way within its stated tolerance (block types: llama.cpp's Q8_0 activations), f32
#: activations everywhere, or Q8_0 activations everywhere (dist_runtime/backends/numba.py).
NUMERICS_NAMES = ("auto", "f32", "q8")
#: The one-process server's prefix cache (``serve --prefix-cache``): KV rows of ended requests kept
#: for new ones that begin with the same tokens (dist_runtime/prefix_cache.py).
DEFAULT_PREFIX_CACHE = "1GiB"
