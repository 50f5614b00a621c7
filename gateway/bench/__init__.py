"""`ctxfuse bench gateway`: what the gateway itself adds to a request.

The full gateway with an instant fake engine (fake_engine.py) and a minimal raw ASGI app that answers
with the same bytes (baseline.py) each run in their own uvicorn process (serve.py); wrk, a separate
load-generator process, drives both with the same POST (load.py); run.py compares them.
"""
