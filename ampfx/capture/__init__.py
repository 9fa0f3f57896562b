"""Capturing a model as a graph: torch.fx with leaves, torch.export, and the checks that accept a capture."""
