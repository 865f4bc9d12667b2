"""The OpenAI Batch API: files, batches, their state machine and the runner that drives them
(docs/batch.md)."""
