"""The base64 extension (``_b64.c``), built at install where a C compiler is found."""

def decode(text: str | bytes, /) -> bytes:
    """Strict base64, as ``base64.b64decode(text, validate=True)``; ``ValueError`` where it
    is not."""
