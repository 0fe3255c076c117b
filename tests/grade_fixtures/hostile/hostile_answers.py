"""Attack (mine): answers built to confuse a grader running beside them: an int whose == says
yes to everything, NaN, an object whose repr raises, a list nested deeper than any parser likes,
a "test" that is a callable object lying about its name. Must: the answers cross as plain data
(the lie stays behind), the grader is not disturbed, nothing is earned."""
# where: before-checks


class Yes(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


class Broken:
    def __repr__(self):
        raise RuntimeError("LABKIT-HOSTILE")


nested = []
for _ in range(100_000):
    nested = [nested]

num_blocks, wasted_slots, internal_fragmentation = Yes(4), float("nan"), Broken()


class Liar:
    @property
    def __name__(self):
        raise RuntimeError("LABKIT-HOSTILE")

    def __call__(self, impl):
        return None


test_generated_tokens_have_slots = Liar()
test_allocation_does_not_slow_with_pool_size = nested
test_shared_blocks_survive_a_free = lambda impl: Yes(0)   # noqa: E731 - returns instead of asserting
