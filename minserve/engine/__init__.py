"""The engine: requests in, tokens out. Today a reference loop; the paged, batched engine builds here."""
