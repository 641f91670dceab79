"""Break each rule R1..R10 once, in a scratch copy, and check that the rule's ref tests notice.

    python scripts/mutation_check.py        # prints CAUGHT / NOT CAUGHT per rule (exit 1 unless all are caught)
    python scripts/mutation_check.py R3 R8  # those rules only

Each mutation disables the one piece of code that implements a rule (in ref/ or the
shared engine and policy); the tests named after that rule must then fail.
"""
import shutil, subprocess, sys, os
MUTATIONS = [
    ("R1", "ref/offloader.py", "            host.copy_(m.source())  # blocking", "            host.copy_(m.source()); host[:1] ^= 1"),
    ("R2", "actoffload/engine.py", '''            raise RuntimeError(
                f"cannot open group {name!r} inside group''', '''            if False: raise RuntimeError(
                f"cannot open group {name!r} inside group'''),
    ("R3", "actoffload/policy.py", [
        ('''        if any(facts[i].parameter for i in members) or flags & marks.PARAMETER:''', '''        if False:'''),
        ('''        if flags & marks.PARAMETER or (facts[members[0]].parameter if len(members) == 1''',
         '''        if False and (facts[members[0]].parameter if len(members) == 1'''),
    ]),
    ("R4", "actoffload/policy.py", '''        elif flags & marks.VETO:''', '''        elif False:'''),
    ("R5", "actoffload/policy.py", '''        for i in span.members[1:]:
            reasons[i] = "alias"''', '''        for i in span.members[1:]:
            reasons[i] = None'''),
    ("R6", "actoffload/engine.py", '''        if held._version != s.version:''', '''        if False:'''),
    ("R7", "actoffload/engine.py", '''        return handle.rebuild(parts)''', '''        return parts[0]'''),
    ("R8", "actoffload/records.py", '''        self.tensor: torch.Tensor | None = t.detach() if self.derived else t''',
     '''        self.tensor: torch.Tensor | None = t'''),
    ("R9", "ref/offloader.py", '''            m.storage = None''', '''            m.keep = m.storage'''),
    ("R10", "actoffload/settings.py", '''    if impl not in IMPLS:''', '''    if impl not in IMPLS and False:'''),
]
failed = False
args = sys.argv[1:]
only = {a for a in args if a[:1] == "R" and a[1:].isdigit()}  # e.g. R3 R8: those rules only
paths = [a for a in args if a not in only]
root = paths[0] if paths else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for rule, path, *change in MUTATIONS:
    if only and rule not in only:
        continue
    old, new = change if len(change) == 2 else (change[0], None)
    work = f"/tmp/mut_{rule}"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(root, work, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__"))
    src = open(os.path.join(work, path)).read()
    # a mutation is one (old, new) replacement, or a list of them: the code as it was written at
    # different times (the first whose code is there once applies)
    choices = [(old, new)] if isinstance(old, str) else old
    applies = [(o, n) for o, n in choices if src.count(o) == 1]
    if not applies:  # the code moved: this rule's mutation must follow it (edit MUTATIONS)
        print(rule, f"NOT APPLIED: {path} has none of the code to break (once):", [o[:80] for o, _ in choices], flush=True)
        failed = True
        shutil.rmtree(work, ignore_errors=True)
        continue
    old, new = applies[0]
    open(os.path.join(work, path), "w").write(src.replace(old, new, 1))
    env = dict(os.environ, TRITON_INTERPRET="1")
    # load the scratch copy's packages by path: an installed actoffload would shadow them
    prog = f"""
import importlib.util, sys
sys.path.insert(0, {work!r})
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path + "/__init__.py", submodule_search_locations=[path])
    mod = importlib.util.module_from_spec(spec); sys.modules[name] = mod; spec.loader.exec_module(mod)
load("actoffload", {work!r} + "/actoffload")
for sub in ("triton_kernels", "ref", "fast"):
    load("actoffload." + sub, {work!r} + "/" + sub)
import actoffload.ref.offloader as r
assert r.__file__.startswith({work!r}), r.__file__
import pytest
sys.exit(pytest.main(["-q", "-x", "-p", "no:cacheprovider", {work + '/tests'!r}, "-k", "{rule}_ and not fast"]))
"""
    r = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, cwd=work, env=env)
    last = [l for l in r.stdout.splitlines() if "passed" in l or "failed" in l or "error" in l.lower()][-1:]
    print(rule, "CAUGHT" if r.returncode == 1 else f"NOT CAUGHT rc={r.returncode}", last, flush=True)
    failed |= r.returncode != 1
    shutil.rmtree(work, ignore_errors=True)
sys.exit(1 if failed else 0)
