"""Cut the device code out of csrc/cuda/softmax.cu for the host emulator (harness.cpp).

Kept verbatim: everything from ``namespace attnkit {`` up to the "host side" banner -- the
constants, the mask, the element helpers (pack2, to_float), the fragment loaders, the four
kernels.  Changed:

- The four helpers whose bodies are inline PTX (``exp2_approx``, ``mma16816``, ``ldsm_x4``,
  ``ldsm_x4_trans``) are removed; harness.cpp defines emulated ones with the same signatures.
  Before removing one, the extractor checks that its body still issues the PTX instruction the
  emulation models, with the operand order it models, so the two cannot drift apart silently.
- ``extern __shared__ __align__(16) uint16_t smem[];`` becomes a pointer to the emulated
  shared memory of the current block.
- The two namespaces left open by the cut are closed.

Any surprise (a missing marker, a changed PTX helper, leftover ``asm``) raises ExtractError
naming what to update.  Usage: ``python extract.py csrc/cuda/softmax.cu kernels.inc``.
"""
import re
import sys

HOST_BANNER = "// host side"
SMEM_DECL = "extern __shared__ __align__(16) uint16_t smem[];"
SMEM_EMULATED = "uint16_t* smem = emu::shared_memory();"

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


def _fail(msg):
    raise ExtractError(
        f"cuda emulator: {msg}.  csrc/cuda/softmax.cu no longer has the shape "
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


def _remove_function(text, name, signature, snippets):
    matches = list(re.finditer(r"__device__ __forceinline__ \w+ " + re.escape(name) + r"\(", text))
    if len(matches) != 1:
        _fail(f"expected one definition of the PTX helper {name}(), found {len(matches)}")
    m = matches[0]
    start = text.rfind("\n", 0, m.start()) + 1
    prev = text.rfind("\n", 0, start - 1) + 1
    if text[prev:start].lstrip().startswith("template"):
        start = prev
    open_brace = text.index("{", m.end())
    close_brace = _matching_brace(text, open_brace)
    head = _normalize(text[start:open_brace])
    if head != _normalize(signature):
        _fail(f"{name}(): signature is now `{head}`, the emulation implements `{signature}`")
    body = _normalize(text[open_brace + 1:close_brace])
    for snippet in snippets:
        if _normalize(snippet) not in body:
            _fail(f"{name}(): its body no longer contains `{_normalize(snippet)}` (the PTX the emulation models)")
    return text[:start] + text[close_brace + 1:]


def extract_device_code(source: str) -> str:
    """The device part of softmax.cu, ready to be #included by harness.cpp."""
    start = source.find("namespace attnkit {")
    if start < 0:
        _fail("no `namespace attnkit {`")
    if not re.match(r"namespace attnkit \{\s*namespace \{", source[start:]):
        _fail("`namespace attnkit {` is not directly followed by `namespace {`")
    banner = source.find(HOST_BANNER, start)
    if banner < 0:
        _fail(f"no `{HOST_BANNER}` banner")
    end = source.rfind("// ----", start, banner)
    if end < 0:
        _fail(f"no `// ----` rule above `{HOST_BANNER}`")
    body = source[start:end]
    for name, (signature, snippets) in PTX_HELPERS.items():
        body = _remove_function(body, name, signature, snippets)
    n = body.count(SMEM_DECL)
    if n == 0 or body.count("__shared__") != n:
        _fail(f"every kernel must declare its shared memory as `{SMEM_DECL}`")
    body = body.replace(SMEM_DECL, SMEM_EMULATED)
    code = _code_only(body)
    for word in ("asm", "__trap", "#include", "__CUDA_ARCH__"):
        if re.search(r"(?<!\w)" + re.escape(word) + r"(?!\w)", code):
            _fail(f"`{word}` left in the device code after removing the PTX helpers")
    header = "// Generated by tests/csrc/cuda_emulator/extract.py from csrc/cuda/softmax.cu; do not edit.\n"
    return header + body + "\n}  // namespace\n}  // namespace attnkit\n"


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as f:
        text = extract_device_code(f.read())
    with open(argv[2], "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
