module tent-rs/go

go 1.19
