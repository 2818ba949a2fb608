"""One worker process: one model runtime serving requests from the router."""
