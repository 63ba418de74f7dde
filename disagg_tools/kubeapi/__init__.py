"""disagg-router: kubeapi — a stand-in Kubernetes API server for tests and the simulator.

No API server runs where this project is tested, so this one serves what worker discovery
reads: core/v1 Pods and discovery.k8s.io/v1 EndpointSlices, list and watch as the API documents
them (resourceVersion semantics, label and field selectors, a chunked JSON-lines watch with
BOOKMARK and ERROR events, 410 Gone past a bounded history), plus the discovery documents
kubectl needs. Tests and the simulator drive it through `server.KubeApiServer` (pods in, faults
on); `python -m disagg_tools.kubeapi` runs it alone. docs/kubeapi-standin.md says what it
leaves out.

Import from its modules (`disagg_tools.kubeapi.server`, `.kubeconfig`): nothing loads eagerly.
"""
