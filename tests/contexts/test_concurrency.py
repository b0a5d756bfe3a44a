import threading

from tandem.contexts import ForwardContext, dbo_current_ubatch_id, dbo_yield, get_forward_context, run_ubatches


def test_two_executors_in_parallel_caller_threads():
    traces = {}
    errors = []
    barrier = threading.Barrier(2)

    def caller(name, kind):
        try:
            barrier.wait(5)
            trace = traces[name] = []
            for _ in range(20):

                def body():
                    for step in range(5):
                        trace.append((dbo_current_ubatch_id(), step))
                        dbo_yield()
                    return name

                assert run_ubatches([body, body], executor=kind) == [name, name]
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [
        threading.Thread(target=caller, args=("a", "thread")),
        threading.Thread(target=caller, args=("b", "thread")),
        threading.Thread(target=caller, args=("c", "greenlet")),
    ]
    barrier = threading.Barrier(len(threads))
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    expected = [(i, step) for step in range(5) for i in range(2)] * 20
    assert traces == {"a": expected, "b": expected, "c": expected}


def test_forward_context_is_per_ubatch_and_survives_switches(executor):
    from tandem.contexts import make_ubatch_contexts

    forward_contexts = [ForwardContext(extras={"name": f"ub{i}"}) for i in range(3)]
    contexts = make_ubatch_contexts(3, executor=executor, forward_contexts=forward_contexts)

    def body():
        seen = []
        for _ in range(3):
            seen.append(get_forward_context().extras["name"])
            dbo_yield()
        return seen

    assert run_ubatches([body] * 3, executor=executor, contexts=contexts) == [
        ["ub0"] * 3,
        ["ub1"] * 3,
        ["ub2"] * 3,
    ]
    assert get_forward_context() is None


def test_ubatches_inherit_the_callers_forward_context(executor):
    from tandem.contexts import set_forward_context

    with set_forward_context(ForwardContext(extras={"step": 7})):
        seen = run_ubatches([lambda: get_forward_context().extras["step"]] * 2, executor=executor)
    assert seen == [7, 7]
