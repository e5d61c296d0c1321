"""The TPU compiler's verdict on our transfer programs, for a deployment shape.

libtpu compiles for compile-only TPU topologies on any host, and its
``memory_analysis()``/``cost_analysis()`` are what that TPU would do: HBM
scratch, host-memory aliasing, bytes accessed, out-of-memory. The JAX CPU
backend hides all of these, so the TPU claims of this project are checked
here: by the test suite (``tests/tpu_compiler``), ``make bench-tpu-aot`` and
``python -m tpu_offload.selfcheck``.

The KV cache is described exactly as tpu-inference builds it: its own shape
function and sharding (``create_kv_caches``), asked for abstract values
instead of allocating. Import after vLLM's platform is resolved (on a TPU
host it is; on CPU, see ``tpu_offload.testing.cpu_support.prepare_vllm``).
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Callable, Sequence
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh

from tpu_offload.connector.shapes import MODELS, ModelShape, padded_kv_heads  # noqa: F401 (aot.MODELS)
from tpu_offload.jax_backend.engine import DEFAULT_MAX_SLAB_BYTES, plan_transfers
from tpu_offload.jax_backend.layout import KVLayout, replicated_axes
from tpu_offload.jax_backend.programs import Programs

MIB = 1 << 20
REPLICATED_SCATTER_ACCESS = 6  # bytes accessed / bytes written, scatter with replicated heads (measured 5.2)
# Environment libtpu needs to compile without a TPU (set before JAX is imported).
COMPILE_ONLY_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost"}


def compile_only_mesh(topology: str, tp: int, attn_dp: int = 1) -> Mesh:
    """tpu-inference's 7-axis Auto mesh (``NEW_MODEL_DESIGN``) over the first ``tp`` compile-only devices;
    ``attn_dp``: DP attention turns that many ways of TP into attention-DP ranks (the "attn_dp" axis)."""
    from jax.experimental import topologies
    from tpu_inference.layers.common.sharding import MESH_AXIS_NAMES

    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    if tp > len(devices) or tp % attn_dp:
        raise ValueError(f"TP {tp} (attention DP {attn_dp}) needs {tp} devices; {topology} has {len(devices)}")
    sizes = {"model": tp // attn_dp, "attn_dp": attn_dp}
    shape = tuple(sizes.get(name, 1) for name in MESH_AXIS_NAMES)
    return Mesh(np.array(devices[:tp]).reshape(shape), MESH_AXIS_NAMES,
                axis_types=(AxisType.Auto,) * len(MESH_AXIS_NAMES))


def kv_cache_avals(mesh: Mesh, model: ModelShape, num_blocks: int, block_size: int) -> list:
    """One abstract array per layer, with tpu-inference's own shape and sharding."""
    from tpu_inference.runner import kv_cache

    heads, _ = padded_kv_heads(model, mesh.shape["model"])  # attention-DP ranks hold whole heads
    abstract = lambda shape, dtype, sharding: (lambda: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))
    with mock.patch.object(kv_cache, "_get_kv_cache_allocator", abstract):
        return kv_cache.create_kv_caches(num_blocks, block_size, heads, model.head_dim, mesh,
                                         [f"layer.{i}" for i in range(model.layers)],
                                         cache_dtype=jnp.dtype(model.dtype), use_mla=model.use_mla)


def deployment_programs(caches: Sequence, mesh: Mesh, *, num_slots: int, blocks_per_chunk: int,
                        staging_blocks: int, head_replicas: int = 1, memory_kind: str = "pinned_host",
                        max_slab_bytes: int = DEFAULT_MAX_SLAB_BYTES, kernel: str | None = None,
                        host_copy: str | None = None) -> Programs:
    """The product's own programs for this deployment, nothing allocated."""
    layout = KVLayout.from_caches(caches, mesh, head_replicas=head_replicas)
    return plan_transfers(layout, num_slots=num_slots, blocks_per_chunk=blocks_per_chunk,
                          staging_blocks=staging_blocks, memory_kind=memory_kind,
                          max_slab_bytes=max_slab_bytes, kernel=kernel, host_copy=host_copy).programs


@dataclasses.dataclass
class Figures:
    """One compiled program, per device, as the TPU compiler reports it."""

    program: str
    compile_s: float
    hbm_scratch: int  # temp_size_in_bytes
    bytes_accessed: int  # cost_analysis; a loop's body is counted once
    moved: int  # bytes one trip moves (a loop: one block or chunk; else the whole call)
    host_argument: int
    host_alias: int
    host_temp: int
    host_output: int
    on_chip_prefetch: int = 0  # bytes the compiler copies into on-chip memory ahead of use (from the HLO)

    @property
    def accessed_per_moved(self) -> float:
        return self.bytes_accessed / self.moved if self.moved else float("nan")

    @property
    def hbm_accessed(self) -> int:
        """``bytes_accessed`` without what prefetching into on-chip memory adds: the cost model counts each
        prefetched byte four more times (the factor is measured, not documented: the copy in and its
        completion, presumably a read and a write each) beside the op that then reads it there instead of
        from HBM. Measured on the device_put path's ``put_chunks``
        (TPU7x, four cache layouts, 1 to 64 chunks): 4.0x the pass in bytes accessed wherever half its
        chunks were prefetched, 2.00-2.01x after this correction at every size (read each chunk, write it)."""
        return self.bytes_accessed - 4 * self.on_chip_prefetch

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "accessed_per_moved": round(self.accessed_per_moved, 3)}


# A copy-start whose destination (the first of its output tuple) is in memory space 1, on-chip memory.
_PREFETCH = re.compile(r"= \((\w+)\[([\d,]*)\]\{[^}]*\bS\(1\)\}[^\n]*? copy-start\(")


def on_chip_prefetch(hlo: str) -> int:
    """Bytes the compiled program's memory-space assignment copies into on-chip memory (VMEM) ahead of
    their use, from its HLO: bounded by that memory, so a fixed share of a large pass and most of a small
    one (``Figures.hbm_accessed``)."""
    total = 0
    for dtype, dims in _PREFETCH.findall(hlo):
        bits = 8 if dtype == "pred" else int(re.search(r"\d+", dtype).group())
        total += int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) * bits // 8
    return total


def figures(name: str, build: Callable, moved: int) -> Figures:
    t0 = time.perf_counter()
    compiled = build()
    dt = time.perf_counter() - t0
    m = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return Figures(program=name, compile_s=dt, hbm_scratch=int(m.temp_size_in_bytes),
                   bytes_accessed=int(cost.get("bytes accessed", 0)), moved=moved,
                   host_argument=int(getattr(m, "host_argument_size_in_bytes", 0)),
                   host_alias=int(getattr(m, "host_alias_size_in_bytes", 0)),
                   host_temp=int(getattr(m, "host_temp_size_in_bytes", 0)),
                   host_output=int(getattr(m, "host_output_size_in_bytes", 0)),
                   on_chip_prefetch=on_chip_prefetch(compiled.as_text()))


def measure(programs: Programs, path: str = "program") -> dict[str, Figures]:
    """Compile every transfer program (what start-up precompiles) and read its figures.

    ``moved`` is the per-device amount of one call: gather/scatter a whole
    staging buffer (a full pass; the cost model does not see inside a DMA
    kernel, so its bytes accessed are those of the ops around it: the
    replicas' ring; a loop's body it counts once); store/load one chunk, the
    slab allocator one slab row.
    """
    blocks = programs.staging_blocks
    block = programs.layout.device_block_bytes() * blocks  # a device's pieces: what gather moves
    # under DP attention a device writes only its rank's share of the blocks
    written = blocks * sum(g.local_elems * jnp.dtype(g.dtype).itemsize * len(g.layers) // g.ranks
                           for g in programs.layout.groups)
    # a chunk per device, where it is held (under DP attention on its rank's devices only)
    chunk = sum(g.piece_bytes for g in programs.layout.groups) * programs.bpc
    if path == "device_put":  # the host side is the runtime's device_put of chunks sliced out of staging
        builders = {"gather": programs.gather, "scatter": programs.scatter, "take_chunks": programs.take_chunks,
                    "put_chunks": programs.put_chunks}
    else:
        builders = {"gather": programs.gather, "scatter": programs.scatter, "store": programs.store,
                    "load": programs.load, "alloc_slabs": programs._slab_allocator}
        if programs.ranks > 1:  # a load that also carries chunks to other ranks (one ring pass)
            builders["load_cross"] = lambda: programs.load(cross=True)
    # scatter writes the whole head shard (replicas x the piece) into the cache
    moved = {"gather": block, "scatter": written, "store": chunk, "load": chunk, "alloc_slabs": chunk,
             "load_cross": chunk * programs.cross_chunks * (programs.ranks - 1),  # what its ring carries
             "take_chunks": block, "put_chunks": block}  # every chunk of a pass
    return {name: figures(name, build, moved[name]) for name, build in builders.items()}


def slab_device_bytes(programs: Programs) -> int:
    """One (the largest) host slab's bytes per device: what one store/load call takes and must update in place."""
    return max(programs.slab_rows) * programs.layout.device_block_bytes() * programs.bpc


def budget_failures(programs: Programs, figs: dict[str, Figures]) -> list[str]:
    """Every budget a program misses (empty: the deployment fits), in words an operator can act on.

    gather/scatter: HBM scratch <= 1.1x and bytes accessed <= 3x what a full
    pass moves; store/load: the host slabs read and updated in place (host alias =
    host argument for store, no host temporaries); slab allocation: HBM
    scratch no bigger than one slab row, whatever the tier's size.
    """
    out = []
    replicated = any(g.replicas > 1 for g in programs.layout.groups)
    for name in ("gather", "scatter"):
        f = figs[name]
        # Replicated KV heads / MLA with the loop kernel: the scatter also ring-shifts the missing slices
        # between the replicas (a collective a TP > KV-heads deployment cannot avoid); its budget is 6x.
        limit = REPLICATED_SCATTER_ACCESS if (replicated and name == "scatter" and programs.kernel == "loop") else 3
        if f.hbm_scratch > 1.1 * f.moved:
            out.append(f"{name}: {f.hbm_scratch / MIB:.1f} MiB of HBM scratch for {f.moved / MIB:.2f} MiB moved per pass")
        if f.bytes_accessed > limit * f.moved:
            out.append(f"{name}: {f.bytes_accessed / MIB:.1f} MiB accessed for {f.moved / MIB:.2f} MiB moved per pass")
    for name in ("take_chunks", "put_chunks"):  # device_put path: a pass's chunks in place, nothing more
        f = figs.get(name)
        if f is not None and (f.hbm_scratch > 1.1 * f.moved or f.bytes_accessed > 3 * f.moved):
            out.append(f"{name}: {f.hbm_scratch / MIB:.1f} MiB of HBM scratch, {f.bytes_accessed / MIB:.1f} MiB "
                       f"accessed for {f.moved / MIB:.2f} MiB of chunks")
    if "store" not in figs:
        return out
    slab = slab_device_bytes(programs)
    st, ld = figs["store"], figs["load"]
    if st.host_alias != st.host_argument or st.host_argument < slab:
        out.append(f"store: host slabs not updated in place (host argument {st.host_argument / MIB:.0f} MiB, "
                   f"alias {st.host_alias / MIB:.0f} MiB, slab {slab / MIB:.0f} MiB)")
    loads = [ld] + ([figs["load_cross"]] if "load_cross" in figs else [])
    for f in loads:
        if f.host_argument < slab or f.host_output:
            out.append(f"{f.program}: host slab not read in place (host argument {f.host_argument / MIB:.0f} MiB, "
                       f"host output {f.host_output / MIB:.0f} MiB)")
    for f in [st] + loads:
        if f.host_temp:
            out.append(f"{f.program}: {f.host_temp / MIB:.1f} MiB of host temporaries")
    alloc = figs["alloc_slabs"]
    if alloc.hbm_scratch > slab / 16:  # filling slabs on HBM first needs a whole slab (2 GiB at TPU7x)
        out.append(f"alloc_slabs: {alloc.hbm_scratch / MIB:.1f} MiB of HBM scratch for {slab / MIB:.0f} MiB slabs")
    return out


def replicated_over(caches: Sequence, mesh: Mesh) -> tuple[str, ...]:
    """Mesh axes (of size > 1) over which every device of the cache holds the same bytes."""
    return tuple(replicated_axes(mesh, tuple(caches[0].sharding.spec)))


# HLO instructions that are no work on the TensorCore (names, views, control).
_FREE_OPS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
             "replica-id", "opt-barrier", "copy-done", "copy-start"}


def tensorcore_ops(hlo: str, trips: int) -> int:
    """TensorCore ops one call of a compiled program runs, from its optimized HLO text: the entry
    computation's instructions (a fusion or a kernel custom-call is one op), plus each ``while``
    body's times its trips: ``known_trip_count`` where the compiler knows it, else ``trips`` (a
    loop over the blocks of the call). Views and names (parameter, tuple, bitcast, ...) are free."""
    comps, name, body = {}, None, []
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head:
            name, body = ("ENTRY" if head.group(1) else head.group(2)), []
        elif line.startswith("}") and name is not None:
            comps[name], name = body, None
        elif name is not None and "=" in line:
            body.append(line)

    def count(comp: str, seen=()) -> int:
        n = 0
        for ins in comps.get(comp, []):
            op = _opcode(ins)
            if op in _FREE_OPS:
                continue
            if op == "while":
                b = re.search(r"\bbody=%?([\w.\-]+)", ins).group(1)
                known = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins)
                n += (int(known.group(1)) if known else trips) * count(b, seen + (comp,))
                continue
            n += 1
        return n

    return count("ENTRY")


def _opcode(ins: str) -> str:
    """The opcode of one HLO instruction line (``%x = <shape> opcode(...)``), past a tuple shape."""
    rest = ins.split("=", 1)[1].lstrip()
    if rest.startswith("("):  # a tuple shape: skip to its closing parenthesis
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                rest = rest[i + 1:]
                break
    else:
        rest = rest.split(" ", 1)[1] if " " in rest else ""
    m = re.match(r"\s*([\w\-]+)\(", rest)
    return m.group(1) if m else ""
