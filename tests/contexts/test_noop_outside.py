from tandem import contexts as c


def test_every_dbo_function_is_a_noop_outside_a_ubatch():
    assert c.dbo_enabled() is False
    assert c.dbo_current_ubatch_id() == 0
    calls = []
    c.dbo_register_recv_hook(lambda: calls.append("hook"))
    for fn in (
        c.dbo_yield,
        c.dbo_maybe_run_recv_hook,
        c.dbo_switch_to_comm,
        c.dbo_switch_to_compute,
        c.dbo_switch_to_comm_sync,
        c.dbo_switch_to_compute_sync,
        c.dbo_yield_and_switch_from_compute_to_comm,
        c.dbo_yield_and_switch_from_comm_to_compute,
    ):
        assert fn() is None
    assert calls == []
    assert c.current_ubatch_context() is None
