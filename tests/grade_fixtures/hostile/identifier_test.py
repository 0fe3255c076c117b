"""Attack (mine): "tests" that recognise the implementation they are given by reading its code
through closures, instead of testing its behaviour. They would pass in the student's kernel;
the grading process runs a passing test again from its source, and this source reaches for
closures. Must: nothing earned (not run again: it reads the implementations), flagged (the
threat model of docs/grading.md)."""
# where: before-checks
import types


def _origins(cls):
    names = []
    for method in ("allocate_block", "free_sequence_blocks", "fork_blocks", "schedule_iteration"):
        fn = getattr(cls, method, None)
        while fn is not None and fn.__closure__:
            inner = [c.cell_contents for c in fn.__closure__ if isinstance(c.cell_contents, types.FunctionType)]
            fn = inner[-1] if inner else None
            if fn is not None and not fn.__closure__:
                names.append(fn.__qualname__)
    return names


def _correct(impl):
    names = _origins(impl.BlockManager) + _origins(impl.Scheduler)
    return all(n.startswith(("PagedBlockManager.", "PagedScheduler.")) for n in names)


def test_generated_tokens_have_slots(impl):
    assert _correct(impl), "LABKIT-HOSTILE"


test_allocation_does_not_slow_with_pool_size = test_shared_blocks_survive_a_free = test_generated_tokens_have_slots
