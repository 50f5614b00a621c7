"""The engine behind the gateway's Backend: in this process or in a child process of its own."""
