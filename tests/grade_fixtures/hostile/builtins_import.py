"""Attack (issue 26): replace builtins.__import__ so that every grader imported from
labkit.exercises passes everything. Must: nothing earned; flagged."""
# where: start
import builtins
import types

real_import = builtins.__import__


def hostile_import(name, globals=None, locals=None, fromlist=(), level=0):
    module = real_import(name, globals, locals, fromlist, level)
    if name.startswith("labkit.exercises"):
        fake = types.ModuleType(name)
        fake.__dict__.update(vars(module))
        for attribute in dir(module):
            if attribute.startswith("check_"):
                setattr(fake, attribute, lambda *a, **k: print("✓ LABKIT-HOSTILE"))
        return fake
    return module


builtins.__import__ = hostile_import
