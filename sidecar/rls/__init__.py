"""The Envoy edge: RLS v3 protobuf in and out (`convert`), the decision path as bytes (`service`),
and the gRPC transport that carries it (`server`).

Only this package imports Envoy's protobuf types; everything behind it speaks `sidecar.model`.
"""
