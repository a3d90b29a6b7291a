"""Many nodes: membership and the coordinator (``coord/``), the authenticated data plane
(``dataplane/``), the cluster's newest save of each path (``truth``), backup copies
(``replication``), the persist election and its writer fence, clock watching, and the
cluster facade (``cluster``) that composes them."""
