"""Adapters to other tools: TritonBench, and FlashInfer's forward norms measured beside the contract."""
