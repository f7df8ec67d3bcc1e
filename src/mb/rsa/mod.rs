//! Multi-buffer RSA-CRT private operation with PSS and PKCS#1 v1.5 padding (see `docs` in this module).
