"""The model on the device and its ground truth: decode graph, prefill, batches, buffers, weights, generation."""
