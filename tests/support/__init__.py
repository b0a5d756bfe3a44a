"""What tests share, test doubles included (no test imports another test module:
tests/test_test_imports.py): real `tandem serve` processes and checks against them
(server_process), the in-memory `FakeEngine` (fake_engine) and an app on a uvicorn thread
(live_app), tiny-moe engine runs (engine_runs), the command line as a subprocess (cli),
tiny HF checkpoints (hf_checkpoints), MoE problems (moe_cases), the real clients' venvs
(clients)."""
