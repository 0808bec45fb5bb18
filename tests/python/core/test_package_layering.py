"""strata.torch's modules in layers: MODULE_ORDER lists them bottom to top, and a module may
import (at the top or inside a function, relatively or by its full name) only the strata
modules listed below it. A module of the package missing from the list, an import of a strata
module not in it, or one of a module at its own level or above fails, naming file:line. Read
from the source (ast), nothing imported: it runs without torch and without libstrata."""

import ast
import pathlib
import shutil

PACKAGE = pathlib.Path(__file__).resolve().parents[3] / "bindings" / "python" / "strata"

# Bottom to top. strata._lib and strata.core (the ctypes layer over the C ABI) are below the
# whole package; strata.torch itself (its __init__, the public surface) is its top.
MODULE_ORDER = [
    "strata._lib",
    "strata.errors",
    "strata.host_buffers",  # the runtime's host buffers under its one host budget
    "strata.atomic_dir",  # the runtime's atomic checkpoint directory
    "strata._host",  # host probes any binding reads: MemAvailable, free disk, file systems
    "strata.core",
    "strata.step_plan",  # the library's step-memory plan (strata_step_plan_*), any framework
    "strata._sharding",  # the data-parallel chunk sizes and shard size, any framework
    "strata.atomic_dir",  # the library's atomic checkpoint directories, any framework
    "strata.torch._host",  # host probes: MemAvailable, free disk, a NUMA node's CPUs
    "strata.torch._logit_trace",  # a forward's logits followed from its head to its loss (torch)
    "strata.torch._chunked_ce",  # the chunked linear cross-entropy as one function
    "strata.torch._chunked_loss",  # the causal-LM loss over chunks of tokens (torch; the plan's chunk)
    "strata.torch._foreign",  # DDP, FSDP, DeepSpeed over an offloaded model refused (torch only)
    "strata.torch._allocator",  # torch's CUDA caching allocator settings
    "strata.torch._step",  # what torch measures for the step plan (the device as torch sees it)
    "strata.torch._params",  # per-parameter bookkeeping, a table keyed by the parameter
    "strata.torch._surgery",  # model surgery: blocks, shared parameters, meta modules, swap
    "strata.torch._weights",  # offload(weights=): a safetensors checkpoint as the source
    "strata.torch._replay",  # a block's forward state replayed for its recompute
    "strata.torch._captured",  # what Hugging Face records inside a streamed block, with grad
    "strata.torch._agreement",  # DataParallelError; EveryRank: a set-up step's outcome agreed
    "strata.torch._distributed",  # DataParallel, Mesh (collectives), chunk sizes
    "strata.torch._ulysses",  # Ulysses attention (all-to-all over the context-parallel group)
    "strata.torch._context_parallel",  # context_parallel(): groups, batch shards, the loss
    "strata.torch._grads",  # StreamedGrad
    "strata.torch._measure",  # what a block saves, measured on fake tensors; selective contexts
    # Which blocks keep their activations (strata/torch/activations/): the plan's, executed.
    "strata.torch.activations",  # the folder's __init__: its docstring only
    "strata.torch.activations.measures",  # BlockMeasures: what each block saves
    "strata.torch.activations.memory",  # StepMemory: the measured step's peaks by interval
    "strata.torch.activations.keeper",  # ActivationKeeper: the plan, executed
    "strata.torch._planning",  # sizing: budgets, resident blocks, the NVMe placement check
    "strata.torch._regenerate",  # block inputs dropped and regenerated (checkpoint groups)
    "strata.torch._spill_pool",  # the spilled checkpoints' host buffers
    "strata.torch._tiled_mlp",  # the blocks' MLP over sequence tiles; its bytes a token
    "strata.torch._spill_plan",  # what strata.torch measures for the checkpoint-homes plan
    "strata.torch._spill_report",  # what the spiller says in placement() and OOM notes
    "strata.torch._spill",  # block checkpoints spilled to host memory when the device is short
    "strata.torch._streamed",  # a streamed parameter's place in Strata; filling tensors
    # Where parameters live (strata/torch/layout/): whole on one process, or sharded.
    "strata.torch.layout",  # the folder's __init__: its docstring only
    "strata.torch.layout.local",  # LocalLayout: every parameter whole in this process
    "strata.torch.layout.streams",  # the side streams' helpers
    "strata.torch.layout.chunks",  # ShardedParam; a rank's chunk read, written, gathered
    "strata.torch.layout.replica",  # HostReplica: the host replica of the weights (pieces)
    "strata.torch.layout.gather",  # BlockGathers: the blocks all-gathered for their passes
    "strata.torch.layout.reduce",  # GradReducer: the grads reduced; their sums of squares
    "strata.torch.layout.sharded",  # ShardedLayout: data parallelism over those parts
    # The session layer (strata/torch/session/): its parts, then StrataSession over them.
    "strata.torch.session",  # the folder's __init__: its docstring only
    "strata.torch.session.runtime",  # SessionChoices; the runtime and what is made beside it
    "strata.torch.session.builder",  # the blocks laid out in Strata (registered, written)
    "strata.torch.session.passes",  # the step: each block's passes, the grads they deliver
    "strata.torch.session.placer",  # where the training state lives: chosen, predicted, said
    "strata.torch.session.session",  # StrataSession: the state, the parts, the values
    "strata.torch._block",  # a streamed block's forward (checkpointed autograd function)
    "strata.torch._hooks",  # the model's state_dict / load / _apply / forward hooks
    # The paging layer (strata/torch/paging/): its parts, then the pager over them.
    "strata.torch.paging",  # the folder's __init__: its docstring only
    "strata.torch.paging.groups",  # which masters page, grouped; a paged tensor's bytes
    "strata.torch.paging.host",  # HostCopies: the host copies under the host budget
    "strata.torch.paging.buffers",  # FlatBuffers: a group's flat device buffer
    "strata.torch.paging.sizing",  # PageSizing: how many groups page (auto, timed window)
    "strata.torch.paging.outbound",  # Outbound: the copies out, freed FREE_LAG points later
    "strata.torch.paging.inbound",  # Inbound: the copies back, as the device has room
    "strata.torch.paging.pager",  # StatePager: the state's way out and back
    # The optimizer layer (strata/torch/optim/): its parts, the shared base, the optimizers.
    "strata.torch.optim",  # the folder's __init__: its docstring only
    "strata.torch.optim.checks",  # what an optimizer's creation refuses
    "strata.torch.optim.resident",  # torch's optimizer over the resident masters; the pager
    "strata.torch.optim.state",  # the state as torch's optimizers hold it: in and out
    "strata.torch.optim.base",  # StrataOptimizer: what every strata.torch optimizer shares
    "strata.torch.optim.kinds",  # AdamW, Adam, SGD, Lion, Adagrad
    "strata.torch._checkpoint",  # save_checkpoint / load_checkpoint
    "strata.torch._gathered",  # gathered(): the streamed parameters' values in a with-block
    # offload()'s stages (strata/torch/offloading/), then offload() running them.
    "strata.torch.offloading",  # the folder's __init__: its docstring only
    "strata.torch.offloading.rollback",  # the undo log of every change a stage makes
    "strata.torch.offloading.request",  # the arguments checked and resolved
    "strata.torch.offloading.residents",  # the model outside the blocks; resident blocks
    "strata.torch.offloading.install",  # host budget, blocks' forwards and hooks, model.strata
    "strata.torch._offload",  # offload(): validate, plan, build, install, move residents
    "strata.torch._hf_trainer",  # StrataTrainer: the Hugging Face Trainer without DDP
    "strata.torch",
]


# The modules directly in strata/ (strata.torch and strata.jax have orders of their own), bottom
# to top: the ctypes declarations, the errors and DLPack over them, strata.core's parts (one
# job each), strata.core (their public face), the step plan over it, the package's __init__.
CORE_ORDER = [
    "strata._lib",
    "strata.errors",
    "strata.dlpack",
    "strata._abi",  # strata.h's constant tables and its dump convention
    "strata._sizes",  # what streaming takes of each tier (strata_layout_query)
    "strata._host",  # host probes any binding reads: MemAvailable, free disk, file systems
    "strata._placement",  # place(): where weights and optimizer state live
    "strata._tiering",  # the NVMe tier's budgets and placement, for every binding
    "strata._runtime",  # Runtime, Tensor
    "strata._streaming",  # Executor, Optimizer
    "strata.host_buffers",  # the runtime's host buffers under its one host budget
    "strata.atomic_dir",  # the runtime's atomic checkpoint directory
    "strata.core",
    "strata.step_plan",
    "strata._sharding",  # the data-parallel chunk sizes and shard size (no imports)
    "strata",
]


def module_name(path, root):
    """The dotted name of the module at `path` under `root` (the folder holding strata/)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path, name, root):
    """(line, module) for every import in the file: top-level or nested, relative or
    absolute; `from X import y` counts as X.y where X.y is a module file, else as X."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                up = parts[:len(parts) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                sub = base + "." + alias.name
                is_module = any((root / (sub.replace(".", "/") + ext)).exists()
                                for ext in (".py", "/__init__.py"))
                found.append((node.lineno, sub if is_module else base))
    return found


def violations(root, order, package="strata.torch", recursive=True):
    """What breaks the layering of `package` under `root`, one line each, file:line first;
    not `recursive`: of its own modules only, not its subpackages'."""
    rank = {name: i for i, name in enumerate(order)}
    out = []
    folder = root / package.replace(".", "/")
    for path in sorted(folder.rglob("*.py") if recursive else folder.glob("*.py")):
        name = module_name(path, root)
        where = path.relative_to(root)
        if name not in rank:
            out.append("%s:1: module %s is not in MODULE_ORDER" % (where, name))
            continue
        for line, target in imported_modules(path, name, root):
            if target != "strata" and not target.startswith("strata."):
                continue  # not ours (torch, the standard library, optional packages)
            if target not in rank:
                out.append("%s:%d: %s imports %s, which is not in MODULE_ORDER"
                           % (where, line, name, target))
            elif rank[target] >= rank[name]:
                out.append("%s:%d: %s imports %s, which is not below it in MODULE_ORDER"
                           % (where, line, name, target))
    return out


def test_strata_torch_imports_only_downwards():
    problems = violations(PACKAGE.parent, MODULE_ORDER)
    assert not problems, "\n".join(problems)


def test_strata_core_and_its_parts_import_only_downwards():
    problems = violations(PACKAGE.parent, CORE_ORDER, package="strata", recursive=False)
    assert not problems, "\n".join(problems)


def test_each_folder_is_one_layer():
    """A folder of strata.torch (session/, optim/, offloading/) is one layer: its modules stand
    together in MODULE_ORDER, its __init__ first (it imports none of them), so nothing of
    another layer sits between its parts and a folder's modules never import upwards out of
    it. Every folder with an __init__ is listed."""
    torch_dir = PACKAGE / "torch"
    folders = {}
    for rank, name in enumerate(MODULE_ORDER):
        parts = name.split(".")
        if parts[:2] == ["strata", "torch"] and len(parts) > 2 and (torch_dir / parts[2]).is_dir():
            folders.setdefault(parts[2], []).append(rank)
    assert set(folders) == {p.name for p in torch_dir.iterdir() if (p / "__init__.py").exists()}
    for folder, ranks in folders.items():
        assert ranks == list(range(ranks[0], ranks[0] + len(ranks))), \
            "%s/'s modules are not together in MODULE_ORDER" % folder
        assert MODULE_ORDER[ranks[0]] == "strata.torch." + folder, \
            "%s/__init__ is not the first of its folder in MODULE_ORDER" % folder


def test_every_listed_module_exists():
    for name in MODULE_ORDER + CORE_ORDER:
        path = PACKAGE.parent / name.replace(".", "/")
        assert path.with_suffix(".py").exists() or (path / "__init__.py").exists(), name


def test_a_planted_violation_is_caught(tmp_path):
    """The real package copied, then broken three ways: the bottom module importing the top
    one inside a function, a module importing an unlisted strata module, and a module that is
    not in the list. Each is named by file and line."""
    root = tmp_path / "python"
    shutil.copytree(PACKAGE, root / "strata", ignore=shutil.ignore_patterns("__pycache__"))
    assert violations(root, MODULE_ORDER) == []
    host = root / "strata" / "torch" / "_host.py"
    lines = len(host.read_text().splitlines())
    host.write_text(host.read_text() + "\n\ndef planted():\n    from ._offload import offload\n"
                    "    return offload\n")
    grads = root / "strata" / "torch" / "_grads.py"
    grads.write_text("from strata.jax import _ffi\n" + grads.read_text())
    (root / "strata" / "torch" / "_new.py").write_text("X = 1\n")
    problems = violations(root, MODULE_ORDER)
    assert problems == [
        "strata/torch/_grads.py:1: strata.torch._grads imports strata.jax._ffi, which is not "
        "in MODULE_ORDER",
        "strata/torch/_host.py:%d: strata.torch._host imports strata.torch._offload, which is "
        "not below it in MODULE_ORDER" % (lines + 4),
        "strata/torch/_new.py:1: module strata.torch._new is not in MODULE_ORDER"], problems
