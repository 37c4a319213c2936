"""treespec-sglang's stand-in for ``sgl_kernel`` in spawned SGLang processes on a CPU machine.

This directory is only ever on ``sys.path`` behind every real location (it is appended by
``treespec_sglang.plugin.cpu.install()``, which runs only when no real ``sgl_kernel`` exists), so a
real install always wins. Importing it installs the stand-ins and becomes that module.
"""


from treespec_sglang.plugin import cpu as _cpu

_cpu.activate()  # sys.modules["sgl_kernel"] becomes the stand-in module, which this import returns
