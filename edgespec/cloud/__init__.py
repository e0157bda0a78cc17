"""Cloud-edge speculative decoding: the device drafts, a server verifies (protocol in docs/cloud_protocol.md)."""
