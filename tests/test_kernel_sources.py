"""Each format's CUDA kernel lives in its own folder of `kvcalib/formats/`, beside its layout and launch, and reads as
the compiler gets it through `kernels_cupy.source.source_of`: every `#include` inlined, looked up beside the file
first, then among the kernels every format shares (`kernels_cupy/`). CPU only: the text is what CuPy compiles (its
source hash keys the compiled binary), so the same text is the same kernel."""

import importlib
from pathlib import Path

import pytest

from kernels_cupy.source import SHARED, source_of

ROOT = Path(__file__).resolve().parents[1]
# each module that launches a format's kernel, and that kernel's file name
KERNELS = {"kvcalib.formats.int2.launch": "int2_decode.cu", "kvcalib.formats.int2.layout": "reorder.cu",
           "kvcalib.formats.vq.launch": "vq_decode.cu", "kvcalib.formats.codebook.launch": "codebook_decode.cu"}


@pytest.mark.parametrize("module,name", list(KERNELS.items()))
def test_a_format_launches_the_kernel_beside_it_with_every_include_inlined(module, name):
    mod = importlib.import_module(module)
    kernel = Path(mod.KERNEL)
    assert kernel == Path(mod.__file__).with_name(name) and kernel.is_file()
    text = source_of(mod.KERNEL)
    assert not [line for line in text.splitlines() if line.startswith('#include "')]
    for line in kernel.read_text().splitlines():  # each shared header the file names is in the text, whole
        if line.startswith('#include "'):
            assert (SHARED / line.split('"')[1]).read_text().splitlines()[0] in text


def test_every_kernel_source_is_in_a_format_folder_or_shared():
    """No format's kernel left in the shared folder: there, only the runtime's own kernels and the shared headers."""
    formats = sorted(p.name for p in (ROOT / "kvcalib" / "formats").glob("*/*.cu"))
    assert formats == sorted(KERNELS.values())
    assert not {p.name for p in SHARED.glob("*.cu")} & set(formats)


def test_an_include_is_read_beside_the_file_before_the_shared_folder(tmp_path):
    """A header beside the kernel wins over the shared one of that name; without it, the shared one is read; each
    name is inlined once (a file that names the header twice gets it once). Planted: includes read from the shared
    folder first fail here."""
    shared_first = (SHARED / "decode_common.cuh").read_text().splitlines()[0]
    kernel = tmp_path / "k.cu"
    kernel.write_text('#include "decode_common.cuh"\n#include "decode_common.cuh"\n// body\n')
    text = source_of(kernel)
    assert text.count(shared_first) == 1 and text.endswith("// body\n")
    (tmp_path / "decode_common.cuh").write_text("// the local header\n")
    text = source_of(kernel)
    assert "// the local header" in text and shared_first not in text
    assert source_of("gemv.cu") == source_of(SHARED / "gemv.cu")  # a shared kernel by name, as the runtime names it
