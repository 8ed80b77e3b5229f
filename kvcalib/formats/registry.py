"""The formats the caches may hold, in the order they are tried: the first whose kernel reads a method's declared
blocks serves them (`kvcalib.runtime.cache.kernel_format`). A new family adds its folder and one line here."""

from .codebook.format import CodebookFormat
from .int2.format import Int2Format
from .vq.format import VQFormat

FORMATS = (Int2Format(), VQFormat(), CodebookFormat())
