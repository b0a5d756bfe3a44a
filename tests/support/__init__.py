"""What tests share, test doubles included (no test imports another test module:
tests/test_test_imports.py): the in-memory `FakeEngine` (fake_engine) and an app on a uvicorn thread
(live_app), tiny-moe engine runs (engine_runs), the command line as a subprocess (cli),
tiny HF checkpoints (hf_checkpoints), MoE problems (moe_cases), the real clients' venvs
(clients), `--hardware here` profiles with given figures (host_profiles). Real `tandem serve`
processes (server_process) and the namespace cluster
(netns_cluster) live in `tandem.testing`, which benchmarks import too."""
