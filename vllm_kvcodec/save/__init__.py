"""The save path: gather chunks out of paged memory -> encode -> put, in the background, within a byte budget."""
