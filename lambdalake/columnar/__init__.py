"""Columnar Avro in the Confluent wire format: whole Arrow columns encoded (:mod:`.encode`) and framed
values decoded into Arrow (:mod:`.decode`) with numpy, instead of one Python object per record."""

from lambdalake.columnar.decode import ColumnarDecoder, Decoded
from lambdalake.columnar.encode import ColumnarEncoder, EncodeError

__all__ = ["ColumnarDecoder", "ColumnarEncoder", "Decoded", "EncodeError"]
