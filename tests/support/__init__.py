"""Shared test helpers and doubles: real servers, tiny HF checkpoints, MoE problems."""
