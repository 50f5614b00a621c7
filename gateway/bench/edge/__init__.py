"""`ctxfuse bench edge`: what the edge link saves on the wire and what the agent adds to a request.

Everything runs on loopback: the gateway's plain-HTTP listener and its mutual-TLS edge listener (one
Gateway, one chunk store) over the instant fake engine (gateway/bench/fake_engine.py) in their own
process, as in the cloud, and the edge agent in front of the edge listener in this one (rig.py). A prose-like
document of a set token count (document.py) is asked several questions through the agent to count
bytes on the link; then the same request bodies go app -> agent -> gateway and app -> gateway,
interleaved, to time what the agent adds (run.py). cli.py holds the command line and the table.
"""
