"""SSD (speculative speculative decoding): fan-out planning, wire protocol, draft worker and client."""
