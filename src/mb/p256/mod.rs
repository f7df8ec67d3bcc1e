//! Multi-buffer ECDSA P-256 signing.
