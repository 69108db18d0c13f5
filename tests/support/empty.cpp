// Keeps pcpkv_test_support non-empty when no helper sources exist yet.
