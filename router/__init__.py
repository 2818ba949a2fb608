"""The front door: TF Serving's gRPC API, request routing to workers, liveness of workers."""
