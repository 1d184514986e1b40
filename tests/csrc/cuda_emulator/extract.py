"""Cut the device code out of a CUDA kernel file (csrc/cuda/softmax.cu, sparse.cu, linear.cu, hopfield.cu) for
the host emulator (harness.cpp and the harnesses built on it).

Kept verbatim: everything from the file's ``namespace attnkit {`` up to the "host side" banner --
the constants, the masks, the element helpers, the fragment loaders, the kernels -- preceded by the
device part of each project header the file includes (but the host-only ``host_utils.cuh``), in include order (``#include
"mma_sm80.cuh"``: the shared element helpers, PTX helpers and fragment loaders; softmax.cu and
sparse.cu then ``#include "flash_tiles.cuh"``: their shared tile geometry, shared-memory layouts
and FlashAttention tile steps, which use mma_sm80.cuh's helpers and so come after it), inlined at
the top of the file's namespace, where the real compile sees them.  Changed:

- The seven helpers whose bodies are inline PTX (``exp2_approx``, ``mma16816``, ``ldsm_x4``,
  ``ldsm_x4_trans``, ``cp_async16``, ``cp_async_commit``, ``cp_async_wait``) are removed; harness.cpp defines emulated ones with the same signatures.
  Before removing one, the extractor checks that its body still issues the PTX instruction the
  emulation models, with the operand order it models, so the two cannot drift apart silently.
  Each must be defined exactly once in the file and its headers together (or, in a file that
  never calls it, not at all: hopfield.cu).
- The kernels' ``extern __shared__`` declarations (the two forms of SHARED_MEMORY) become pointers
  to the emulated shared memory of the current block.
- The two namespaces left open by the cut are closed.
- Every pointer becomes a checked pointer (instrument_pointers): `T*` -> ``emu::ptr<T>``,
  ``reinterpret_cast`` / ``const_cast`` to a pointer type -> ``emu::reinterpret_ptr`` /
  ``emu::const_ptr_cast``, ``&x`` -> ``emu::addr(x)``; harness.cpp's ptr checks every access
  against the allocation the pointer was made from (README.md, "Checked pointers").

Any surprise (a missing marker, a changed PTX helper, a header that was not given, leftover
``asm``) raises ExtractError naming what to update.
Usage: ``python extract.py csrc/cuda/softmax.cu kernels.inc``.
"""
import re
import sys
from pathlib import Path

HOST_BANNER = "// host side"
# Project headers that hold host code only (torch headers, input checks, launch helpers): no device
# part to inline, and their torch includes would not compile in the emulator; they are skipped.
HOST_ONLY_HEADERS = ("host_utils.cuh",)
# A kernel's shared-memory declaration -> its emulated replacement (softmax.cu and sparse.cu use
# the first form, linear.cu the second).
SHARED_MEMORY = {
    "extern __shared__ __align__(16) uint16_t smem[];": "uint16_t* smem = emu::shared_memory();",
    "extern __shared__ __align__(16) unsigned char smem_raw[];":
        "unsigned char* smem_raw = reinterpret_cast<unsigned char*>(emu::shared_memory());",
    # hopfield.cu (float32 tiles, no tensor cores)
    "extern __shared__ float smem_raw[];": "float* smem_raw = reinterpret_cast<float*>(emu::shared_memory());",
    # Hopper kernels (sm90_ptx.cuh: TMA destinations with the 128-byte swizzle are 1024-byte aligned;
    # the emulated shared memory starts 1024-byte aligned in the shared window, harness_sm90.h)
    "extern __shared__ __align__(1024) unsigned char smem_raw[];":
        "unsigned char* smem_raw = reinterpret_cast<unsigned char*>(emu::shared_memory());",
    "extern __shared__ __align__(128) unsigned char smem_raw[];":
        "unsigned char* smem_raw = reinterpret_cast<unsigned char*>(emu::shared_memory());",
    "extern __shared__ uint8_t smem_raw[];": "uint8_t* smem_raw = reinterpret_cast<uint8_t*>(emu::shared_memory());",
}
# `#include "name"` (quotes, not angle brackets): a project header, whose device part is inlined.
PROJECT_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"', re.M)
NAMESPACES_OPEN = re.compile(r"namespace attnkit \{\s*namespace \{")

_MMA_OPERANDS = (
    ': "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) '
    ': "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));'
)
_MMA_REGS = '"{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\\n"'
_LDSM_OPERANDS = ': "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));'

# name -> (signature as harness.cpp defines it, snippets the body must contain).  Whitespace is
# normalized and adjacent string literals are merged before matching.
PTX_HELPERS = {
    "exp2_approx": (
        "__device__ __forceinline__ float exp2_approx(float x)",
        ['asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;'],
    ),
    "mma16816": (
        "template <bool kBF16> __device__ __forceinline__ void mma16816("
        "float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2])",
        [
            'if constexpr (kBF16) { asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 '
            + _MMA_REGS[1:] + " " + _MMA_OPERANDS
            + ' } else { asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 '
            + _MMA_REGS[1:] + " " + _MMA_OPERANDS + " }",
        ],
    ),
    "ldsm_x4": (
        "__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const uint16_t* row)",
        [
            "const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));",
            'asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\\n" '
            + _LDSM_OPERANDS,
        ],
    ),
    "ldsm_x4_trans": (
        "__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const uint16_t* row)",
        [
            "const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));",
            'asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\\n" '
            + _LDSM_OPERANDS,
        ],
    ),
    # cp.async with its groups (harness.cpp: a copy NaN-fills its destination when issued and lands
    # only at a wait_group that covers its group).
    "cp_async16": (
        "__device__ __forceinline__ void cp_async16(uint16_t* dst, const uint16_t* src)",
        [
            "const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(dst));",
            'asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\\n" : : "r"(addr), "l"(src) : "memory");',
        ],
    ),
    "cp_async_commit": (
        "__device__ __forceinline__ void cp_async_commit()",
        ['asm volatile("cp.async.commit_group;\\n" : : : "memory");'],
    ),
    "cp_async_wait": (
        "template <int kN> __device__ __forceinline__ void cp_async_wait()",
        ['asm volatile("cp.async.wait_group %0;\\n" : : "n"(kN) : "memory");'],
    ),
}


# ---------------------------------------------------------------------------------------------
# csrc/cuda/sm90_ptx.cuh (Hopper): its PTX helpers are removed after checking that each body is
# EXACTLY (comments and whitespace aside) the one below, whose PTX harness_sm90.h models; its other
# functions (smem_addr, smem_desc_sw128) run as written.  The `#if ... #define ATTNKIT_SM90A`
# guard of the header becomes `#define ATTNKIT_SM90A 1` (the emulator is an sm_90a device).
# ---------------------------------------------------------------------------------------------

SM90_HEADER = "sm90_ptx.cuh"
SM90A_GUARD = re.compile(
    r"#if defined\(__CUDA_ARCH__\) && \(__CUDA_ARCH__ == 900\) && defined\(__CUDA_ARCH_FEAT_SM90_ALL\)[ \t]*\n"
    r"#define ATTNKIT_SM90A 1[ \t]*\n#else[ \t]*\n#define ATTNKIT_SM90A 0[ \t]*\n#endif[ \t]*\n")
SM90A_EMULATED = "#define ATTNKIT_SM90A 1  // extract.py: the emulator models an sm_90a device\n"


def _guarded(*statements):
    return "#if ATTNKIT_SM90A " + " ".join(statements) + " #endif"


def _wgmma_asm(n, dtype, rs):
    """The asm statement of sm90_ptx.cuh's wgmma_ss / wgmma_rs for m64n{n}k16 and `dtype` (the
    operand numbering: n / 2 accumulators, then A (a descriptor or 4 registers), B's descriptor,
    scale-d, imm-trans-b)."""
    nd = n // 2
    regs = ", ".join(f"%{i}" for i in range(nd))
    # d[N / 8][4]: register 4j + e is d[j][e] (wgmma_rs: d[kOff + j][e], a part of a wider d)
    off = "kOff + " if rs else ""
    outs = ", ".join(f'"+f"(d[{off}{i // 4}][{i % 4}])' for i in range(nd))
    if rs:
        scale, trans = nd + 5, nd + 6
        operands = "{" + ", ".join(f"%{nd + i}" for i in range(4)) + f"}}, %{nd + 4}, p, 1, 1, %{trans}"
        ins = '"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB)'
    else:
        scale, trans = nd + 2, nd + 3
        operands = f"%{nd}, %{nd + 1}, p, 1, 1, 0, %{trans}"
        ins = '"l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransB)'
    return (f'asm volatile( "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{scale}, 0;\\n" '
            f'"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{dtype}.{dtype} " "{{{regs}}}, " '
            f'"{operands};\\n}}\\n" : {outs} : {ins});')


def _wgmma_body(name, rs):
    def pick(n):
        return (f"if constexpr (kBF16) {{ {_wgmma_asm(n, 'bf16', rs)} }} "
                f"else {{ {_wgmma_asm(n, 'f16', rs)} }}")
    inside = (f' static_assert(kOff >= 0 && kOff + kN / 8 <= kNt, "{name}: the accumulators lie inside d");'
              if rs else "")
    return (f'#if ATTNKIT_SM90A static_assert(kN == 64 || kN == 128, "{name}: N is 64 or 128");{inside} '
            f"if constexpr (kN == 64) {{ {pick(64)} }} else {{ {pick(128)} }} #else __trap(); #endif")


def _acc_fence(c, x):
    return ("#pragma unroll for (int i = 0; i < kNt; ++i) { #pragma unroll for (int e = 0; e < 4; ++e) "
            f'asm volatile("" : "+{c}"({x}[i][e]) : : "memory"); }}')

# name -> [(signature as harness_sm90.h defines it, the whole body)], one per overload.
SM90_HELPERS = {
    "mbar_init": (
        "__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count)",
        _guarded('asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\\n" : : "r"(smem_addr(bar)), "r"(count) '
                 ': "memory");'),
    ),
    "mbar_arrive_expect_tx": (
        "__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes)",
        _guarded('asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\\n" : : '
                 '"r"(smem_addr(bar)), "r"(bytes) : "memory");'),
    ),
    "mbar_arrive": (
        "__device__ __forceinline__ void mbar_arrive(uint64_t* bar)",
        _guarded('asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\\n" : : "r"(smem_addr(bar)) : "memory");'),
    ),
    "mbar_wait": (
        "__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity)",
        _guarded('asm volatile( "{\\n.reg .pred done;\\nWAIT_AGAIN:\\n" '
                 '"mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\\n" "@!done bra WAIT_AGAIN;\\n}\\n" '
                 ': : "r"(smem_addr(bar)), "r"(parity) : "memory");'),
    ),
    "fence_proxy_async": (
        "__device__ __forceinline__ void fence_proxy_async()",
        _guarded('asm volatile("fence.proxy.async.shared::cta;\\n" : : : "memory");'),
    ),
    "tma_load_4d": (
        "__device__ __forceinline__ void tma_load_4d(void* dst, const void* tensor_map, int c0, int c1, int c2, "
        "int c3, uint64_t* bar)",
        _guarded('asm volatile( "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes " '
                 '"[%0], [%1, {%3, %4, %5, %6}], [%2];\\n" : : "r"(smem_addr(dst)), "l"(tensor_map), '
                 '"r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");'),
    ),
    "setmaxnreg_inc": (
        "template <int kRegs> __device__ __forceinline__ void setmaxnreg_inc()",
        _guarded('asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\\n" : : "n"(kRegs));'),
    ),
    "setmaxnreg_dec": (
        "template <int kRegs> __device__ __forceinline__ void setmaxnreg_dec()",
        _guarded('asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\\n" : : "n"(kRegs));'),
    ),
    "wgmma_fence": (
        "__device__ __forceinline__ void wgmma_fence()",
        _guarded('asm volatile("wgmma.fence.sync.aligned;\\n" : : : "memory");'),
    ),
    "wgmma_commit": (
        "__device__ __forceinline__ void wgmma_commit()",
        _guarded('asm volatile("wgmma.commit_group.sync.aligned;\\n" : : : "memory");'),
    ),
    "wgmma_wait": (
        "template <int kPending> __device__ __forceinline__ void wgmma_wait()",
        _guarded('asm volatile("wgmma.wait_group.sync.aligned %0;\\n" : : "n"(kPending) : "memory");'),
    ),
    "acc_fence": [
        ("template <int kNt> __device__ __forceinline__ void acc_fence(float (&d)[kNt][4])",
         _guarded(_acc_fence("f", "d"))),
        ("template <int kNt> __device__ __forceinline__ void acc_fence(uint32_t (&a)[kNt][4])",
         _guarded(_acc_fence("r", "a"))),
    ],
    # Named barriers (bar.sync / bar.arrive id, count): harness_sm90.h's named_barrier.
    "named_bar_sync": (
        "__device__ __forceinline__ void named_bar_sync(int id, int count)",
        _guarded('asm volatile("bar.sync %0, %1;\\n" : : "r"(id), "r"(count) : "memory");'),
    ),
    "named_bar_arrive": (
        "__device__ __forceinline__ void named_bar_arrive(int id, int count)",
        _guarded('asm volatile("bar.arrive %0, %1;\\n" : : "r"(id), "r"(count) : "memory");'),
    ),
    "wgmma_ss": (
        "template <bool kBF16, int kN, int kTransB> __device__ __forceinline__ void wgmma_ss("
        "float (&d)[kN / 8][4], uint64_t desc_a, uint64_t desc_b, int scale_d)",
        _wgmma_body("wgmma_ss", rs=False),
    ),
    "wgmma_rs": (
        "template <bool kBF16, int kN, int kTransB, int kOff = 0, int kNt = kN / 8> __device__ __forceinline__ "
        "void wgmma_rs(float (&d)[kNt][4], const uint32_t (&a)[4], uint64_t desc_b, int scale_d)",
        _wgmma_body("wgmma_rs", rs=True),
    ),
}


class ExtractError(RuntimeError):
    pass


def _fail(msg, name="the kernel file"):
    raise ExtractError(
        f"cuda emulator: {msg}.  {name} no longer has the shape "
        "tests/csrc/cuda_emulator/extract.py expects; update extract.py (and harness.cpp) with it."
    )


def _normalize(text):
    text = re.sub(r'"\s*"', "", text)  # "abc " "def" -> "abc def"
    return " ".join(text.split())


def _skip_literal_or_comment(text, i):
    """If text[i] starts a string, char literal or comment, the index just past it, else i."""
    if text.startswith("//", i):
        j = text.find("\n", i)
        return len(text) if j < 0 else j + 1
    if text.startswith("/*", i):
        j = text.find("*/", i + 2)
        return len(text) if j < 0 else j + 2
    if text[i] in "\"'":
        quote, j = text[i], i + 1
        while j < len(text) and text[j] != quote:
            j += 2 if text[j] == "\\" else 1
        return j + 1
    return i


def _code_only(text):
    """text without its comments and string / char literals."""
    out, i = [], 0
    while i < len(text):
        j = _skip_literal_or_comment(text, i)
        if j == i:
            out.append(text[i])
            i += 1
        else:
            out.append(" ")
            i = j
    return "".join(out)


def _matching_brace(text, open_index):
    depth, i = 0, open_index
    while i < len(text):
        j = _skip_literal_or_comment(text, i)
        if j != i:
            i = j
            continue
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    _fail("unbalanced braces")


def _definition(text, m):
    """(start, open brace, close brace) of the function definition whose name `m` matched: from
    its `template <...>` line (if any) to its closing brace."""
    start = text.rfind("\n", 0, m.start()) + 1
    prev = text.rfind("\n", 0, start - 1) + 1
    if text[prev:start].lstrip().startswith("template"):
        start = prev
    open_brace = text.index("{", m.end())
    return start, open_brace, _matching_brace(text, open_brace)


def _remove_function(text, name, signature, snippets, where):
    matches = list(re.finditer(r"__device__ __forceinline__ \w+ " + re.escape(name) + r"\(", text))
    if not matches and not re.search(r"(?<!\w)" + re.escape(name) + r"(?!\w)", _code_only(text)):
        return text  # a file that neither defines nor calls it (hopfield.cu: SIMT only, no mma_sm80.cuh)
    if len(matches) != 1:
        _fail(f"expected one definition of the PTX helper {name}() in {where}, found {len(matches)}", where)
    start, open_brace, close_brace = _definition(text, matches[0])
    head = _normalize(text[start:open_brace])
    if head != _normalize(signature):
        _fail(f"{name}(): signature is now `{head}`, the emulation implements `{signature}`", where)
    body = _normalize(_without_comments(text[open_brace + 1:close_brace]))
    for snippet in snippets:
        if _normalize(snippet) not in body:
            _fail(f"{name}(): its body no longer contains `{_normalize(snippet)}` (the PTX the emulation models)",
                  where)
    return text[:start] + text[close_brace + 1:]


def _remove_overloads(text, name, variants, where):
    """text without the definitions of `name`, one per (signature, body) of `variants`: each must
    be there exactly once, with exactly that body, comments and whitespace aside (sm90_ptx.cuh's
    helpers; its acc_fence has two overloads)."""
    pattern = re.compile(r"__device__ __forceinline__ \w+ " + re.escape(name) + r"\(")
    found = pattern.findall(text)
    if not found and not re.search(r"(?<!\w)" + re.escape(name) + r"(?!\w)", _code_only(text)):
        return text  # a file that neither defines nor calls it
    if len(found) != len(variants):
        _fail(f"expected {len(variants)} definition(s) of the PTX helper {name}() in {where}, found {len(found)}",
              where)
    expected = {_normalize(signature): body for signature, body in variants}
    for _ in variants:
        start, open_brace, close_brace = _definition(text, pattern.search(text))
        head = _normalize(text[start:open_brace])
        if head not in expected:
            _fail(f"{name}(): a definition has the signature `{head}`; the emulation implements " +
                  " and ".join(f"`{h}`" for h in expected), where)
        body, wanted = _normalize(_without_comments(text[open_brace + 1:close_brace])), _normalize(expected.pop(head))
        if body != wanted:
            _fail(f"{name}(): its body is now `{body}`; the emulation models exactly `{wanted}`", where)
        text = text[:start] + text[close_brace + 1:]
    return text


def _header_device_part(header, text):
    """What a project header defines inside ``namespace attnkit { namespace { ... } }``; outside
    that block it may hold only comments and preprocessor lines (#pragma once, #include <...>),
    so nothing it declares is lost by the cut."""
    m = NAMESPACES_OPEN.search(text)
    if m is None:
        _fail("no `namespace attnkit { namespace {` block", header)
    inner_close = _matching_brace(text, m.end() - 1)
    outer_close = _matching_brace(text, text.index("{", m.start()))
    outside = _code_only(text[:m.start()] + "\n" + text[outer_close + 1:])
    for line in outside.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            _fail(f"code outside its `namespace attnkit {{ namespace {{` block: `{line.strip()}`", header)
    if _code_only(text[inner_close + 1:outer_close]).strip():
        _fail("code between the closing braces of its two namespaces", header)
    if PROJECT_INCLUDE.search(_without_comments(text)):
        _fail("it includes another project header (inlining is one level deep)", header)
    return text[m.end():inner_close]


def included_headers(path):
    """{name: text} of the project headers (``#include "..."``) that the kernel file at `path`
    includes, read from its directory; the host-only ones (HOST_ONLY_HEADERS) left out."""
    path = Path(path)
    return {name: (path.parent / name).read_text(encoding="utf-8")
            for name in _project_includes(path.read_text(encoding="utf-8"))}


def _project_includes(text):
    """Names of the project headers `text` includes, in order, but the host-only ones."""
    return [name for name in PROJECT_INCLUDE.findall(_without_comments(text)) if name not in HOST_ONLY_HEADERS]


def extract_device_code(source: str, headers=None, name="csrc/cuda/softmax.cu", checked_pointers=True) -> str:
    """The device part of a kernel file (its text `source`), ready to be #included by a harness.

    headers: {include name: text} of the project headers the file includes (see
    included_headers); their device parts are inlined, in include order, where the file's
    device code begins.  name: the file, for messages.  checked_pointers: every pointer type of
    the device code becomes harness.cpp's bounds-checked ``emu::ptr`` (instrument_pointers)."""
    headers = headers or {}
    start = source.find("namespace attnkit {")
    if start < 0:
        _fail("no `namespace attnkit {`", name)
    opened = NAMESPACES_OPEN.match(source, start)
    if opened is None:
        _fail("`namespace attnkit {` is not directly followed by `namespace {`", name)
    banner = source.find(HOST_BANNER, start)
    if banner < 0:
        _fail(f"no `{HOST_BANNER}` banner", name)
    end = source.rfind("// ----", start, banner)
    if end < 0:
        _fail(f"no `// ----` rule above `{HOST_BANNER}`", name)
    inlined, includes = [], _project_includes(source[:start])
    for include in includes:
        if include not in headers:
            _fail(f"it includes \"{include}\", which was not given to the extractor", name)
        inlined.append(f"\n// ---- inlined from {include} ----\n{_header_device_part(include, headers[include])}"
                       f"// ---- end of {include} ----\n")
    body = source[start:opened.end()] + "".join(inlined) + source[opened.end():end]
    where = " + ".join([name, *includes])
    sm90 = any(Path(include).name == SM90_HEADER for include in includes)
    if sm90:
        body, guards = SM90A_GUARD.subn(SM90A_EMULATED, body)
        if guards != 1:
            _fail(f"expected the `#if defined(__CUDA_ARCH__) ... #define ATTNKIT_SM90A 1 #else ... 0 #endif` guard "
                  f"once in {SM90_HEADER}, found it {guards} times", where)
    for helper, (signature, snippets) in PTX_HELPERS.items():
        body = _remove_function(body, helper, signature, snippets, where)
    for helper, variants in SM90_HELPERS.items():
        body = _remove_overloads(body, helper, variants if isinstance(variants, list) else [variants], where)
    declared = sum(body.count(decl) for decl in SHARED_MEMORY)
    if declared == 0 or body.count("__shared__") != declared:
        _fail("every kernel must declare its shared memory in one of the forms " + " / ".join(
            f"`{decl}`" for decl in SHARED_MEMORY), name)
    for decl, emulated in SHARED_MEMORY.items():
        body = body.replace(decl, emulated)
    code = _code_only(body)
    # (`__trap` may stay in a Hopper kernel's `#if ATTNKIT_SM90A ... #else __trap(); #endif`: the
    # preprocessor drops it, ATTNKIT_SM90A being 1; harness_sm90.h defines it as a failure anyway.)
    for word in ("asm", "#include", "__CUDA_ARCH__") + (() if sm90 else ("__trap",)):
        if re.search(r"(?<!\w)" + re.escape(word) + r"(?!\w)", code):
            _fail(f"`{word}` left in the device code after removing the PTX helpers", name)
    if checked_pointers:
        body = instrument_pointers(body, name)
    header = f"// Generated by tests/csrc/cuda_emulator/extract.py from {name}; do not edit.\n"
    return header + body + "\n}  // namespace\n}  // namespace attnkit\n"


# ---------------------------------------------------------------------------------------------
# checked pointers: every pointer type of the device code becomes harness.cpp's emu::ptr<T>
# ---------------------------------------------------------------------------------------------

# Type names the device code may point to without declaring them (the file's own structs, enums,
# aliases and template type parameters are found in it).
BUILTIN_TYPES = frozenset(
    "void bool char short int long float double unsigned signed auto size_t ptrdiff_t int8_t uint8_t "
    "int16_t uint16_t int32_t uint32_t int64_t uint64_t uintptr_t uint4 __half __nv_bfloat16 __half2 "
    "__nv_bfloat162 Half BFloat16 CUtensorMap".split())
_TOKEN = re.compile(r"[A-Za-z_]\w*|\d[\w.]*|::|->|\*=|&&|&=|\|\||==|!=|<=|>=|\+\+|--|\+=|-=|/=|%=|\|=|\^=|\S")
# A `&` after one of these takes an address (unary); after anything else it is `and` or a
# reference declarator (`const Acc<L, A>& acc`, `A& z`).
_UNARY_AMP_AFTER = frozenset(
    "( , = return ? : { ; + - * / % == != && || ! += -= *= /=".split())
# Tokens after which a declaration statement may begin (for `T *a, *b;`: every declarator is
# then a pointer; harness.cpp's ptr replaces the type, so the later `*`s go).
_DECL_START_AFTER = frozenset("; { } : > __device__ __forceinline__ __host__ inline static constexpr".split())
_CASTS = {"reinterpret_cast": "emu::reinterpret_ptr", "const_cast": "emu::const_ptr_cast"}


def _blank(text):
    """text with comments and string / char literals turned into spaces (newlines kept), so that
    positions in it are positions in text."""
    out, i = [], 0
    while i < len(text):
        j = _skip_literal_or_comment(text, i)
        if j == i:
            out.append(text[i])
            i += 1
        else:
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
    return "".join(out)


def _type_names(code):
    names = set(BUILTIN_TYPES)
    names.update(re.findall(r"\b(?:struct|class|union|typename|enum)\s+([A-Za-z_]\w*)", code))
    names.update(re.findall(r"\busing\s+([A-Za-z_]\w*)\s*=", code))
    names.discard("class")  # `enum class X`
    return names


def _value_names(code, names):
    """Names the code declares as values (variables, parameters, members, constants, non-type
    template parameters): those that follow a type name."""
    types = "|".join(sorted((re.escape(n) for n in names), key=len, reverse=True))
    return set(re.findall(r"\b(?:" + types + r")(?:\s*<[^;{}()]*?>)?\s+(?:const\s+)?&?\s*([A-Za-z_]\w*)", code))


def _match_back(toks, j, open_, close):
    """Index of the bracket `open_` matching toks[j] == close (parentheses skipped for angle
    brackets), or None at a statement boundary."""
    depth = parens = 0
    for k in range(j, -1, -1):
        t = toks[k]
        if open_ == "<" and t in (")", "("):
            parens += 1 if t == ")" else -1
            if parens < 0:
                return None
            continue
        if parens:
            continue
        if t == close:
            depth += 1
        elif t == open_:
            depth -= 1
            if depth == 0:
                return k
        elif t in (";", "{", "}"):
            return None
    return None


def _type_start(toks, j, names):
    """If toks[..j] end with a type (`const uint16_t`, `unsigned char`, `const Acc<L, A>`,
    `c10::Half`), the index of its first token, else None."""
    while j >= 0 and toks[j] in ("const", "volatile"):  # east const
        j -= 1
    if j < 0:
        return None
    if toks[j] == ">":
        k = _match_back(toks, j, "<", ">")
        if k is None or k == 0 or toks[k - 1] not in names:
            return None
        s = k - 1
    elif toks[j] in names:
        s = j
        while s > 0 and toks[s - 1] in ("unsigned", "signed", "long", "short"):
            s -= 1
    else:
        return None
    while s >= 2 and toks[s - 1] == "::" and re.match(r"[A-Za-z_]", toks[s - 2]):
        s -= 2
    while s >= 1 and toks[s - 1] in ("const", "volatile", "typename", "struct"):
        s -= 1
    return s


def _closing(toks, k):
    """Index just past the bracket group opening at toks[k]."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    depth = 0
    for m in range(k, len(toks)):
        if toks[m] in pairs:
            depth += 1
        elif toks[m] in pairs.values():
            depth -= 1
            if depth == 0:
                return m + 1
    _fail("unbalanced brackets")


def _enclosing_bracket(toks, k):
    """The unmatched '(', '[' or '{' before toks[k] ('' at file level)."""
    depth = 0
    for m in range(k - 1, -1, -1):
        t = toks[m]
        if t in (")", "]", "}"):
            depth += 1
        elif t in ("(", "[", "{"):
            if depth == 0:
                return t
            depth -= 1
    return ""


def _pointer_declarators(toks, names):
    """[(index of the type's first token, index of the `*`)] for every `T*` of the code."""
    found = []
    for i, t in enumerate(toks):
        if t == "*" and i > 0:
            s = _type_start(toks, i - 1, names)
            if s is not None:
                found.append((s, i))
    return found


def instrument_pointers(code, name="the kernel file"):
    """code with every pointer type `T*` spelled ``emu::ptr<T>`` (harness.cpp: a pointer that
    knows the allocation it points into and checks every dereference against it), every
    ``reinterpret_cast`` / ``const_cast`` to a pointer type spelled ``emu::reinterpret_ptr`` /
    ``emu::const_ptr_cast``, and every address-of ``&x`` spelled ``emu::addr(x)`` (a checked
    pointer too).  So no raw pointer is left in the device code: each global, shared or local
    access goes through a check.  Raises ExtractError for a declaration it cannot rewrite."""
    blank = _blank(code)
    spans = [(m.start(), m.end()) for m in _TOKEN.finditer(blank)]
    toks = [blank[a:b] for a, b in spans]
    names = _type_names(blank)
    edits = []  # (start, end, replacement)
    dropped = set()  # token indices of the `*` of later declarators (`T *a, *b`)
    for s, i in _pointer_declarators(toks, names):
        if i in dropped:
            continue
        nxt = toks[i + 1] if i + 1 < len(toks) else ""
        if nxt in ("*", "const", "volatile", "__restrict__"):
            _fail(f"`{code[spans[s][0]:spans[i + 1][1]]}`: pointers to pointers and const / restrict pointers "
                  "are not rewritten to checked pointers", name)
        type_text = code[spans[s][0]:spans[i - 1][1]]
        if "auto" in toks[s:i]:
            edits.append((spans[i][0], spans[i][1], ""))  # `const auto* x = p`: x is p's type
        else:
            after = code[spans[i][1]:spans[i][1] + 1]
            edits.append((spans[s][0], spans[i][1], f"emu::ptr<{type_text}>" + (" " if re.match(r"\w", after) else "")))
        if s >= 2 and toks[s - 1] == "<" and toks[s - 2] in _CASTS:
            if nxt != ">":
                _fail(f"`{code[spans[s - 2][0]:spans[i + 1][1]]}`: a cast to a pointer type expected", name)
            edits.append((spans[s - 2][0], spans[s - 2][1], _CASTS[toks[s - 2]]))
        elif s >= 1 and toks[s - 1] in _DECL_START_AFTER and _enclosing_bracket(toks, s) in ("{", ""):
            # A declaration statement: its later declarators must be pointers too (`T *a, *b`).
            k, depth = i + 1, 0
            while k < len(toks):
                t = toks[k]
                if t in ("(", "[", "{"):
                    if t == "{" and depth == 0 and toks[k - 1] != "=":
                        break  # a function body
                    depth += 1
                elif t in (")", "]", "}"):
                    depth -= 1
                    if depth < 0:
                        break
                elif depth == 0 and t == ";":
                    break
                elif depth == 0 and t == ",":
                    if toks[k + 1] != "*":
                        line = code[spans[s][0]:code.find("\n", spans[s][0])]
                        _fail(f"`{line.strip()}`: a declaration that mixes pointers and non-pointers "
                              "is not rewritten to checked pointers", name)
                    dropped.add(k + 1)
                    edits.append((spans[k + 1][0], spans[k + 1][1], ""))
                k += 1
    for i, t in enumerate(toks):
        if t != "&" or i == 0 or toks[i - 1] not in _UNARY_AMP_AFTER or _enclosing_bracket(toks, i) == "[":
            continue
        if toks[i - 1] == "(" and i + 3 < len(toks) and toks[i + 2] == ")" and toks[i + 3] in ("[", "("):
            continue  # `uint32_t (&a)[4]`: a reference declarator
        k = i + 1
        if not re.match(r"[A-Za-z_]", toks[k]):
            _fail(f"`&{toks[k]}...`: an address-of whose operand is not a name is not rewritten", name)
        k += 1
        while k < len(toks):
            if toks[k] in ("::", ".", "->") and re.match(r"[A-Za-z_]", toks[k + 1]):
                k += 2
            elif toks[k] in ("[", "("):
                k = _closing(toks, k)
            else:
                break
        edits.append((spans[i][0], spans[i][1], "emu::addr("))
        edits.append((spans[k - 1][1], spans[k - 1][1], ")"))
    out = code
    for start, end, text in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        out = out[:start] + text + out[end:]
    left = _blank(out)
    left_toks = [m.group() for m in _TOKEN.finditer(left)]
    left_names = _type_names(left)
    for s, i in _pointer_declarators(left_toks, left_names):
        _fail(f"a pointer type left after rewriting: `{' '.join(left_toks[s:i + 1])}`", name)
    # `X * y` with X spelled like a type (capitalized, or *_t) that the code does not declare as a
    # value: a pointer to a type declared elsewhere would stay a raw, unchecked pointer.
    values = _value_names(left, left_names)
    for i, t in enumerate(left_toks):
        if t != "*" or i < 1 or i + 1 >= len(left_toks):
            continue
        p = left_toks[i - 1]
        if (re.fullmatch(r"[A-Z]\w*|\w+_t", p) and p not in values and p not in left_names
                and (i < 2 or left_toks[i - 2] not in (".", "->")) and re.match(r"[A-Za-z_]", left_toks[i + 1])):
            _fail(f"`{p} * {left_toks[i + 1]}`: `{p}` is neither a type the device code declares nor a value; if it "
                  "is a type (from a header that is not inlined), add it to extract.BUILTIN_TYPES", name)
    return out


def _without_comments(text):
    """text with its comments blanked (string literals kept: an #include's name is one)."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("//", i) or text.startswith("/*", i):
            j = _skip_literal_or_comment(text, i)
            out.append(" ")
            i = j
        elif text[i] in "\"'":
            j = _skip_literal_or_comment(text, i)
            out.append(text[i:j])
            i = j
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    path = Path(argv[1])
    text = extract_device_code(path.read_text(encoding="utf-8"), included_headers(path), name=str(path))
    Path(argv[2]).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
