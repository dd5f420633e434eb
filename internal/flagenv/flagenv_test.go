package flagenv

import (
	"flag"
	"io"
	"strings"
	"testing"
)

func TestApply(t *testing.T) {
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	seed := fs.Uint("seed", 0, "")
	buckets := fs.Int("buckets", 64, "")
	mode := fs.String("gre-device", "kst-gre", "")
	t.Setenv("KST_SEED", "0x2a")
	t.Setenv("KST_BUCKETS", "32")
	if err := fs.Parse([]string{"--buckets=16"}); err != nil {
		t.Fatal(err)
	}
	if err := Apply(fs, "KST_"); err != nil {
		t.Fatal(err)
	}
	if *seed != 42 || *buckets != 16 || *mode != "kst-gre" {
		t.Fatalf("seed=%d buckets=%d mode=%s; want env seed, flag buckets, default device", *seed, *buckets, *mode)
	}
	t.Setenv("KST_BUCKETS", "many")
	fs2 := flag.NewFlagSet("t", flag.ContinueOnError)
	fs2.Int("buckets", 64, "")
	_ = fs2.Parse(nil)
	if err := Apply(fs2, "KST_"); err == nil || !strings.Contains(err.Error(), "KST_BUCKETS") {
		t.Fatalf("bad env value: err = %v, want one naming KST_BUCKETS", err)
	}
}
