"""How long an idle HTTP connection stays open, on each end of our links.

A client that sends on a kept-alive connection at the moment the server closes it for idling gets
"server disconnected without sending a response": the request never ran, but the client cannot tell
that from a crash. The race is only possible when the client keeps idle connections at least as long
as the server does. So every server of ours holds idle connections longer than any client of ours (or
a common client: httpx and the OpenAI SDK drop theirs after 5 s) keeps them, and our clients drop
theirs first. uvicorn's own default (5 s) equals httpx's, which is the race at its most likely.
"""

from __future__ import annotations

# the nginx default; above the idle limits of common clients and load balancers (60 s is usual)
SERVER_KEEP_ALIVE_S = 75

# the edge uplink, which talks only to our gateway, gives a connection up first
CLIENT_KEEP_ALIVE_S = 60.0

# a router may front foreign backends (vLLM, SGLang) that keep uvicorn's 5 s: it gives connections
# up before that, so with any of them it is never the one that reuses a closing connection
ROUTER_KEEP_ALIVE_S = 4.0
