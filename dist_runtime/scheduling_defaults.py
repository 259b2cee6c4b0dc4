"""The scheduler's default budgets (:class:`~dist_runtime.scheduling.Scheduler`), in a module that
imports nothing: the command line shows them in ``--help`` without loading numpy."""

#: Rows per pass when the caller does not say.  Measured (benchmarks/bench_batching.py, 125M Llama,
#: F32, TBB threads): with 8 sessions decoding while 4 prompts of 512 tokens arrive, the decoding
#: sessions' p99 inter-token time is ~1.5 decode steps at 24 rows a pass, since prompts beside D
#: decode rows fill a pass to a quarter of the budget or add D/2 rows (``Scheduler.next_batch``).
DEFAULT_BATCH_TOKENS = 24
#: Prompt rows a pass may take while no session is generating (no one waits between tokens).
IDLE_PREFILL_TOKENS = 512
