"""Cut the device code out of a CUDA kernel file (csrc/cuda/softmax.cu, sparse.cu, linear.cu) for
the host emulator (harness.cpp and the harnesses built on it).

Kept verbatim: everything from the file's ``namespace attnkit {`` up to the "host side" banner --
the constants, the masks, the element helpers, the fragment loaders, the kernels -- preceded by the
device part of each project header the file includes (but the host-only ``host_utils.cuh``), in include order (``#include
"mma_sm80.cuh"``: the shared element helpers, PTX helpers and fragment loaders; softmax.cu and
sparse.cu then ``#include "flash_tiles.cuh"``: their shared tile geometry, shared-memory layouts
and FlashAttention tile steps, which use mma_sm80.cuh's helpers and so come after it), inlined at
the top of the file's namespace, where the real compile sees them.  Changed:

- The four helpers whose bodies are inline PTX (``exp2_approx``, ``mma16816``, ``ldsm_x4``,
  ``ldsm_x4_trans``) are removed; harness.cpp defines emulated ones with the same signatures.
  Before removing one, the extractor checks that its body still issues the PTX instruction the
  emulation models, with the operand order it models, so the two cannot drift apart silently.
  Each must be defined exactly once in the file and its headers together (or, in a file that
  never calls it, not at all: hopfield.cu).
- The kernels' ``extern __shared__`` declarations (the two forms of SHARED_MEMORY) become pointers
  to the emulated shared memory of the current block.
- The two namespaces left open by the cut are closed.

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


def _remove_function(text, name, signature, snippets, where):
    matches = list(re.finditer(r"__device__ __forceinline__ \w+ " + re.escape(name) + r"\(", text))
    if not matches and not re.search(r"(?<!\w)" + re.escape(name) + r"(?!\w)", _code_only(text)):
        return text  # a file that neither defines nor calls it (hopfield.cu: SIMT only, no mma_sm80.cuh)
    if len(matches) != 1:
        _fail(f"expected one definition of the PTX helper {name}() in {where}, found {len(matches)}", where)
    m = matches[0]
    start = text.rfind("\n", 0, m.start()) + 1
    prev = text.rfind("\n", 0, start - 1) + 1
    if text[prev:start].lstrip().startswith("template"):
        start = prev
    open_brace = text.index("{", m.end())
    close_brace = _matching_brace(text, open_brace)
    head = _normalize(text[start:open_brace])
    if head != _normalize(signature):
        _fail(f"{name}(): signature is now `{head}`, the emulation implements `{signature}`", where)
    body = _normalize(text[open_brace + 1:close_brace])
    for snippet in snippets:
        if _normalize(snippet) not in body:
            _fail(f"{name}(): its body no longer contains `{_normalize(snippet)}` (the PTX the emulation models)",
                  where)
    return text[:start] + text[close_brace + 1:]


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


def extract_device_code(source: str, headers=None, name="csrc/cuda/softmax.cu") -> str:
    """The device part of a kernel file (its text `source`), ready to be #included by a harness.

    headers: {include name: text} of the project headers the file includes (see
    included_headers); their device parts are inlined, in include order, where the file's
    device code begins.  name: the file, for messages."""
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
    for helper, (signature, snippets) in PTX_HELPERS.items():
        body = _remove_function(body, helper, signature, snippets, where)
    declared = sum(body.count(decl) for decl in SHARED_MEMORY)
    if declared == 0 or body.count("__shared__") != declared:
        _fail("every kernel must declare its shared memory in one of the forms " + " / ".join(
            f"`{decl}`" for decl in SHARED_MEMORY), name)
    for decl, emulated in SHARED_MEMORY.items():
        body = body.replace(decl, emulated)
    code = _code_only(body)
    for word in ("asm", "__trap", "#include", "__CUDA_ARCH__"):
        if re.search(r"(?<!\w)" + re.escape(word) + r"(?!\w)", code):
            _fail(f"`{word}` left in the device code after removing the PTX helpers", name)
    header = f"// Generated by tests/csrc/cuda_emulator/extract.py from {name}; do not edit.\n"
    return header + body + "\n}  // namespace\n}  // namespace attnkit\n"


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
