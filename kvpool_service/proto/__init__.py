"""Generated gRPC code of protos/ (see protos/generate.py); do not edit."""
