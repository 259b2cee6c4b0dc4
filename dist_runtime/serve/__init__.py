"""``dist-runtime serve``: one model behind an OpenAI-compatible HTTP API (docs/serving.md).

``cli`` (the command), ``served_model`` (what the model offers), ``bridge`` (the engine thread between
asyncio and the continuously batched engines), ``api`` and ``schema`` (the endpoints), ``text``
(chat templates, stop strings), ``metrics`` (Prometheus), ``server`` (uvicorn, start and stop),
``static/index.html`` (the web page at ``/``).  Only ``cli`` is imported by ``dist-runtime
--help``; the rest needs the ``serve`` extra (FastAPI, uvicorn, jinja2).
"""
