package testnetns

import (
	"net/netip"

	"github.com/vishvananda/netlink"
)

// VXLANDecap stands in for the endpoint agent's GRE decapsulation device on a
// host kernel without GRE (it implements endpoint.DecapDevice). A VXLAN
// device is also a tunnel device with a local address, so creating,
// recognising, bringing up, addressing and deleting it exercise the same
// kernel calls. The end-to-end lab runs real GRE.
type VXLANDecap struct{}

// NewLink describes a VXLAN device with VNI 42 and the given local address.
func (VXLANDecap) NewLink(name string, local netip.Addr) netlink.Link {
	return &netlink.Vxlan{LinkAttrs: netlink.LinkAttrs{Name: name}, VxlanId: 42, SrcAddr: local.AsSlice(), Port: 4789}
}

// Local returns a VXLAN device's local address.
func (VXLANDecap) Local(l netlink.Link) (netip.Addr, bool) {
	v, ok := l.(*netlink.Vxlan)
	if !ok {
		return netip.Addr{}, false
	}
	a, _ := netip.AddrFromSlice(v.SrcAddr.To4())
	return a, true
}
