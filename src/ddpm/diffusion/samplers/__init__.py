"""Samplers: each turns a GuidedModel and x_T ~ N(0, I) into images in [-1, 1]."""
