package testnetns

import "testing"

func TestSNMPTable(t *testing.T) {
	const text = `Ip: Forwarding DefaultTTL InReceives ForwDatagrams
Ip: 1 64 120 3
Icmp: InMsgs
Icmp: 4
Tcp: RtoAlgorithm RetransSegs
Tcp: 1 17
`
	ip, err := SNMPTable(text, "Ip")
	if err != nil {
		t.Fatal(err)
	}
	if ip["InReceives"] != 120 || ip["ForwDatagrams"] != 3 || len(ip) != 4 {
		t.Errorf("Ip = %v", ip)
	}
	if tcp, err := SNMPTable(text, "Tcp"); err != nil || tcp["RetransSegs"] != 17 {
		t.Errorf("Tcp = %v, %v", tcp, err)
	}
	if _, err := SNMPTable(text, "Udp"); err == nil {
		t.Error("a missing table parsed")
	}
	if _, err := SNMPTable("Ip: A B\nIp: 1\n", "Ip"); err == nil {
		t.Error("a short value line parsed")
	}
}
