"""Attack (issue 26): put fake grader modules in sys.modules under names assembled at run time,
so that a static reading cannot see which modules are replaced. Must: nothing earned; flagged
(sys.modules, and what the kernel showed)."""
# where: start
import sys
import types

for name in ("memory", "bughunt"):
    fake = types.ModuleType("labkit." + "exer" + "cises." + name)
    for grader in ("check_exercise_2", "check_generated_tokens_test", "check_free_list_test",
                   "check_shared_blocks_test"):
        setattr(fake, grader, lambda *a, **k: print("✓ LABKIT-HOSTILE"))
    sys.modules["labkit." + "exer" + "cises." + name] = fake
