"""The harness: the model zoo, a driver for the engine, golden files from HF, parity, sampling tests, benchmarks."""
