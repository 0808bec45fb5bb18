#include "backends/topology/gpu_numa_node.h"

#include <hwloc.h>

#include <cstdio>
#include <fstream>

namespace strata {
namespace {

int numa_node_from_hwloc(unsigned domain, unsigned bus, unsigned dev, unsigned func) {
  hwloc_topology_t topology = nullptr;
  if (hwloc_topology_init(&topology) != 0) return -1;
  int node = -1;
  hwloc_topology_set_io_types_filter(topology, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
  if (hwloc_topology_load(topology) == 0) {
    hwloc_obj_t pci = hwloc_get_pcidev_by_busid(topology, domain, bus, dev, func);
    hwloc_obj_t ancestor = pci != nullptr ? hwloc_get_non_io_ancestor_obj(topology, pci) : nullptr;
    if (ancestor != nullptr && ancestor->nodeset != nullptr &&
        !hwloc_bitmap_iszero(ancestor->nodeset)) {
      node = hwloc_bitmap_first(ancestor->nodeset);
    }
  }
  hwloc_topology_destroy(topology);
  return node;
}

// CUDA writes the domain with 8 digits ("00000000:65:00.0"); sysfs names it with 4.
int numa_node_from_sysfs(unsigned domain, unsigned bus, unsigned dev, unsigned func) {
  char id[32];
  std::snprintf(id, sizeof id, "%04x:%02x:%02x.%x", domain, bus, dev, func);
  std::ifstream in(std::string("/sys/bus/pci/devices/") + id + "/numa_node");
  int node = -1;
  if (!(in >> node)) return -1;
  return node;  // the kernel writes -1 itself when it does not know
}

}  // namespace

int numa_node_of_pci_device(const std::string& pci_bus_id) {
  unsigned domain = 0, bus = 0, dev = 0, func = 0;
  if (pci_bus_id.empty() ||
      std::sscanf(pci_bus_id.c_str(), "%x:%x:%x.%x", &domain, &bus, &dev, &func) != 4) {
    return -1;
  }
  const int node = numa_node_from_hwloc(domain, bus, dev, func);
  return node >= 0 ? node : numa_node_from_sysfs(domain, bus, dev, func);
}

}  // namespace strata
