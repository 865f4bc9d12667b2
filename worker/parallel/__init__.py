"""Tensor parallelism: one worker's model split over the ranks of one torch.distributed group."""
