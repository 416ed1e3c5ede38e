"""Evaluation: FID, KID and IS (torchmetrics) against cached training-set statistics, DDP-sharded sampling."""
