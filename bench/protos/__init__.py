"""Message definitions the load generator speaks besides TF Serving's (KServe v2 gRPC)."""
